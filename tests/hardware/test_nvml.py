"""The one NVML error policy (gpulab.hardware.nvml), on its own and as `gpulab devices` and the
profiler's sampler both apply it: the same fake NVML error means the same thing to both."""

from __future__ import annotations

import pytest

from gpulab.hardware.describe import describe
from gpulab.hardware.nvml import Queries
from gpulab.monitor.parent.sampler import GpuReader
from tests.hardware.fake_nvml import (
    MISSING, NVML_ERROR_FUNCTION_NOT_FOUND, NVML_ERROR_GPU_IS_LOST, NVML_ERROR_NO_PERMISSION, NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_UNKNOWN, FakeGpu, FakeNVMLError, fake_pynvml, machine,
)

# What each failure is, by the policy: (n/a and never asked again, a problem worth saying).
POLICY = {
    NVML_ERROR_NOT_SUPPORTED: (True, False),
    NVML_ERROR_FUNCTION_NOT_FOUND: (True, False),
    MISSING: (True, False),  # this nvidia-ml-py lacks the function
    NVML_ERROR_NO_PERMISSION: (True, True),
    NVML_ERROR_GPU_IS_LOST: (False, True),
    NVML_ERROR_UNKNOWN: (False, True),
}


class Calls:
    """A read that fails with `error` (an NVML code, or raises `error` itself) and counts its calls."""

    def __init__(self, nv, error):
        self.nv, self.error, self.count = nv, error, 0

    def __call__(self):
        self.count += 1
        if self.error == MISSING:
            return self.nv.nvmlNoSuchFunction()
        if isinstance(self.error, int):
            raise FakeNVMLError(self.error)
        raise self.error


@pytest.mark.parametrize("error", list(POLICY))
def test_each_failure_is_na_and_is_asked_again_or_said_as_the_policy_says(error):
    nv = fake_pynvml([])
    q, read = Queries(nv), Calls(nv, error)
    assert [q.query("power", read) for _ in range(3)] == [None] * 3
    never_again, said = POLICY[error]
    assert read.count == (1 if never_again else 3)
    assert ("power" in q.unsupported) == never_again
    assert q.problems == ({"power": "NVML error: " + str(FakeNVMLError(error))} if said else {})


def test_not_found_is_the_callers_nothing_and_no_problem():
    nv = fake_pynvml([])
    q, read = Queries(nv), Calls(nv, NVML_ERROR_NOT_FOUND)
    assert q.query("process samples", read, none_found=[]) == []
    assert q.query("process samples", read) is None
    assert read.count == 2 and q.problems == {} and q.unsupported == set()


def test_the_first_problem_is_the_one_said():
    nv = fake_pynvml([])
    q = Queries(nv)
    q.query("name", Calls(nv, NVML_ERROR_GPU_IS_LOST))
    q.query("memory", Calls(nv, NVML_ERROR_UNKNOWN))
    q.query("name", Calls(nv, NVML_ERROR_UNKNOWN))  # the same query failing again, differently
    assert q.problem == "NVML error: GPU is lost"
    assert q.problems == {"name": "NVML error: GPU is lost", "memory": "NVML error: Unknown Error"}
    assert q.query("uuid", lambda: "GPU-1") == "GPU-1"


@pytest.mark.parametrize("bug", [ValueError("a bug"), KeyError("x"), AttributeError("not the binding's")])
def test_an_error_that_is_not_nvmls_is_a_bug_and_raised(bug):
    nv = fake_pynvml([])
    with pytest.raises(type(bug)):
        Queries(nv).query("power", Calls(nv, bug))


def test_an_attribute_missing_on_an_answer_is_a_bug_not_unsupported():
    nv = fake_pynvml([])
    with pytest.raises(AttributeError):
        Queries(nv).query("utilization", lambda: nv.nvmlDeviceGetCount().gpu)


# ----------------------------------------------------------------------------- both readers


@pytest.mark.parametrize("error", list(POLICY))
def test_gpulab_devices_and_the_sampler_treat_the_same_error_the_same_way(monkeypatch, error):
    never_again, said = POLICY[error]
    gpu = FakeGpu(fails={"nvmlDeviceGetPowerUsage": error})

    nv = machine(monkeypatch, [gpu])
    report = describe()
    # NVML's GPU 0 is the fake one; on a machine with a GPU, torch's own is listed too (first).
    (row,) = [g for g in report["gpus"] if g["nvml_index"] == 0]
    assert row["power_w"] is None and row["temperature_c"] == 41
    warned = report["warnings"] != []
    assert nv.calls["nvmlDeviceGetPowerUsage"] == (0 if error == MISSING else 1)

    nv = machine(monkeypatch, [gpu])
    reader = GpuReader()
    rows = [reader.read()[0] for _ in range(3)]
    reader.close()
    dropped = "power_w" in reader.unsupported().get(0, [])
    asked = nv.calls["nvmlDeviceGetPowerUsage"]
    assert all(row["kernel_active_pct"] == 37.0 for row in rows)  # the other metrics are still read

    assert warned == said
    assert dropped == never_again
    if never_again:
        assert asked == (0 if error == MISSING else 1) and all("power_w" not in row for row in rows)
    else:
        assert asked == 3 and all(row["power_w"] is None for row in rows)


def test_gpulab_devices_and_the_sampler_both_raise_a_bug(monkeypatch):
    machine(monkeypatch, [FakeGpu(fails={"nvmlDeviceGetPowerUsage": ZeroDivisionError("a bug in gpulab")})])
    with pytest.raises(ZeroDivisionError):
        describe()
    reader = GpuReader()
    with pytest.raises(ZeroDivisionError):
        reader.read()
    reader.close()
