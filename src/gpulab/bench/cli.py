"""`gpulab bench` (work in progress: being built for the benchmarks issue)."""

from gpulab.errors import UserError


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks (in progress)")
    p.set_defaults(func=_todo)


def _todo(args) -> int:
    raise UserError("gpulab bench is not built yet")
