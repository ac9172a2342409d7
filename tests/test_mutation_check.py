"""scripts/mutation_check.py plants each bug by replacing a line of the source: a line that changed
since would leave its mutation unplantable, and the test it guards unchecked, until someone runs
the whole script. Each planted text must stand once in its file, and each named test must exist."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_mutations():
    spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "scripts" / "mutation_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.MUTATIONS


def test_every_mutation_can_be_planted_and_names_tests_that_exist():
    mutations = load_mutations()
    unplantable = [m.what for m in mutations if (ROOT / m.file).read_text().count(m.old) != 1]
    assert unplantable == []
    missing = []
    for m in mutations:
        for test in m.tests:
            path, _, name = test.partition("::")
            function = name.split("[")[0]
            if not (ROOT / path).is_file() or (function and f"def {function}(" not in (ROOT / path).read_text()):
                missing.append(test)
    assert missing == []
