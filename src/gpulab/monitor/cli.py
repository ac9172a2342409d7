"""`gpulab profile` (work in progress: being built for the profiling issue)."""

from gpulab.errors import UserError


def add_profile_parser(sub) -> None:
    p = sub.add_parser("profile", help="profile an unmodified training script (in progress)")
    p.set_defaults(func=_todo)


def _todo(args) -> int:
    raise UserError("gpulab profile is not built yet")
