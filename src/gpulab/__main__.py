import sys

# gpulab's own dependencies, said in one line when missing (running from a checkout with
# PYTHONPATH=src and a Python that lacks some of them). Commands import what they need lazily,
# so the check wraps the whole command.
DEPENDENCIES = {"torch": "torch", "numpy": "numpy", "rich": "rich", "matplotlib": "matplotlib", "psutil": "psutil",
                "pynvml": "nvidia-ml-py"}

try:
    from gpulab.cli import leave, main

    code = main()
except ModuleNotFoundError as e:
    top = (e.name or "").partition(".")[0]
    if top not in DEPENDENCIES:
        raise
    sys.exit(f"gpulab: error: this Python lacks {DEPENDENCIES[top]}, which gpulab needs: pip install {DEPENDENCIES[top]} "
             f"(or install gpulab itself: pip install -e .)")
leave(code)
