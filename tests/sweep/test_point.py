"""A failed point's one-line reason (moesim.sweep.point.describe_error)."""

from __future__ import annotations

from moesim.errors import ConfigError
from moesim.sweep.point import describe_error


def _raised(err: BaseException) -> BaseException:
    try:
        raise err
    except BaseException as caught:  # noqa: BLE001 - kept with its traceback
        return caught


def test_a_ray_task_error_is_described_by_the_workers_own_error():
    """Ray's text held the remote traceback in terminal colours: '[36mray::_ray_point()[39m (pid=...) File ...'."""
    class RayTaskErrorLike(Exception):  # Ray names its classes RayTaskError(<the cause's class>)
        def __init__(self, cause: BaseException) -> None:
            super().__init__("\x1b[36mray::_ray_point()\x1b[39m (pid=17651) File worker.py, line 1053 ...")
            self.cause = cause
    RayTaskErrorLike.__name__ = "RayTaskError(ModuleNotFoundError)"
    missing = _raised(ModuleNotFoundError("No module named 'their_policies'"))
    said = describe_error(RayTaskErrorLike(missing))
    assert said.startswith("ModuleNotFoundError: No module named 'their_policies' (at test_point.py:")
    assert "\x1b" not in said and "ray::" not in said
    refused = ConfigError("unknown system 'mine'", field="system")
    assert describe_error(RayTaskErrorLike(refused)) == str(refused)


def test_terminal_colours_and_line_breaks_leave_a_reason():
    said = describe_error(_raised(RuntimeError("\x1b[31mboom\x1b[0m\nsecond line")))
    assert said.startswith("RuntimeError: boom second line (at test_point.py:")
