"""The Ray engine: points as Ray tasks, trace files shipped through the object store once."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from moesim.errors import ConfigError
from moesim.sweep.point import (RETRIES_AFTER_WORKER_DEATH, Finished, cached_profile, columns_of, describe_error,
                                error_row, run_point)
from moesim.sweep.spec import Point, SweepSpec


def _run_ray(spec: SweepSpec, points: list[Point], workers: int, address: str | None,
             started: Callable[[], None], finished: Finished) -> int:
    """Points as Ray tasks, one CPU each; trace and profile files put in the object store once. Returns
    how many points Ray ran again after their worker died."""
    ray = require_ray()
    started_here = not ray.is_initialized()
    if started_here:
        import logging
        kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
        try:
            if address:
                ray.init(address=address, **kwargs)
            else:
                ray.init(num_cpus=workers, **kwargs)
        except Exception as err:  # noqa: BLE001 - Ray raises many kinds; all mean the same to the user
            with_reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
            raise ConfigError(f"Ray did not start: {with_reason}", field="--engine",
                              fix="run `ray stop --force` and retry, or use --engine local") from None
    try:
        remote = ray.remote(num_cpus=1, max_retries=RETRIES_AFTER_WORKER_DEATH)(_ray_point)  # as the local pool
        attempts = ray.remote(num_cpus=0)(Attempts).remote()  # Ray tells the driver nothing of its retries
        shipped: dict[str, ShippedFile] = {}
        profiles: dict[str, Any] = {}
        pending: dict[Any, Point] = {}
        columns = columns_of(points)  # every worker decodes a trace once, with the columns any point reads
        # Ray's workers are not forked from here: they register the user's policies too (one copy, shared)
        policies = ray.put(own_policies(ray))
        for p in points:
            trace, hw = spec.resolve(p.trace), spec.resolve_hw(p.hw)
            if trace not in shipped:
                shipped[trace] = ShippedFile.put(ray, Path(trace))
            if hw not in profiles:  # parsed once here; workers get the object, not the YAML to parse again
                profiles[hw] = ray.put(cached_profile(hw))
            pending[remote.remote(p, shipped[trace], profiles[hw], columns, attempts, policies)] = p
        started()
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=min(len(pending), 32), timeout=0.5)
            for ref in ready:
                point = pending.pop(ref)
                try:
                    row = ray.get(ref)
                except Exception as err:  # noqa: BLE001 - a task whose worker died
                    row = error_row(point, describe_error(err))
                finished(row)
        return ray.get(attempts.retried.remote())
    finally:
        if started_here:
            ray.shutdown()


class Attempts:
    """Run as a Ray actor: how many times each point was started (a second start is Ray's retry)."""

    def __init__(self) -> None:
        self.starts: dict[str, int] = {}

    def start(self, point_id: str) -> None:
        self.starts[point_id] = self.starts.get(point_id, 0) + 1

    def retried(self) -> int:
        return sum(n > 1 for n in self.starts.values())


def require_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError("the ray engine needs Ray, which is not installed", field="--engine",
                          fix="pip install 'moesim[sweep]' (ray>=2.9), or use --engine local") from None
    return ray


def check_ray_address(address: str | None, timeout_s: float = 5.0) -> None:
    """A cluster address ``HOST:PORT`` (or ``ray://HOST:PORT``) that takes no connection is one line now:
    ``ray.init`` retried it for minutes, printing Ray's own log lines, before the sweep could say anything.
    ``auto`` (the cluster this machine runs) is left to Ray."""
    import socket
    if not address or address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"'{address}' is not a Ray cluster address", field="--address",
                          fix="give auto or HEAD_IP:PORT, e.g. 10.0.0.1:6379")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, OverflowError) as err:
        reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
        raise ConfigError(f"no Ray cluster answers at {address}: {reason}", field="--address",
                          fix="start it (ray start --head on HEAD_IP), check the address, or leave --address out "
                              "for a local Ray instance") from None


@dataclass(frozen=True)
class ShippedFile:
    """A file put in Ray's object store once; the reference sits in a list so that Ray passes it
    to tasks unresolved and a worker fetches it only when it has no copy yet."""

    name: str
    digest: str
    ref: list[Any]

    @classmethod
    def put(cls, ray: Any, path: Path) -> "ShippedFile":
        data = path.read_bytes()
        return cls(path.name, hashlib.sha256(data).hexdigest(), [ray.put(data)])


#: per worker process: content digest -> local copy
_LOCAL_COPIES: dict[str, str] = {}


def local_copy(shipped: ShippedFile, fetch: Callable[[Any], bytes]) -> str:
    """This process's copy of ``shipped``, fetched on first use only.

    Copies live in a content-addressed folder under the temporary directory,
    so workers of one machine (and later sweeps) share them.
    """
    if shipped.digest not in _LOCAL_COPIES:
        import tempfile
        folder = Path(tempfile.gettempdir()) / "moesim-sweep-files" / shipped.digest[:32]
        path = folder / shipped.name
        if not path.exists():
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".{shipped.name}.{os.getpid()}.tmp"
            tmp.write_bytes(fetch(shipped.ref[0]))
            os.replace(tmp, path)
        _LOCAL_COPIES[shipped.digest] = str(path)
    return _LOCAL_COPIES[shipped.digest]


def own_policies(ray: Any) -> tuple[list[tuple[str, str]], bytes]:
    """What a worker needs to run the driver's systems of one's own: the modules to import (``--import``, a
    spec's ``import:``, and those a plain ``import`` brought in), and every component and system registered
    beyond the catalogue, pickled (a notebook cell's classes travel by value)."""
    from moesim.policy.imports import imported, modules_of
    from moesim.policy.systems import own_registrations
    registrations = own_registrations()
    classes = [what if kind == "component" else what[1].system_class for kind, what in registrations]
    return imported() + modules_of(classes), ray.cloudpickle.dumps(registrations)


def _register_own(policies: tuple[list[tuple[str, str]], bytes]) -> None:
    """Import and register in this worker what :func:`own_policies` gave (once per process)."""
    import ray

    from moesim.policy.imports import import_again
    from moesim.policy.systems import register_again
    modules, registrations = policies
    if registrations not in _REGISTERED:
        import_again(modules)
        if registrations:
            register_again(ray.cloudpickle.loads(registrations))
        _REGISTERED.add(registrations)


#: the driver's registrations this worker process has made
_REGISTERED: set[bytes] = set()


def _ray_point(point: Point, trace: ShippedFile, profile: Any, columns: list[str], attempts: Any,
               policies: tuple[list[tuple[str, str]], bytes] = ([], b"")) -> dict[str, Any]:
    """One point in a Ray worker: the trace copied to local disk once per machine (validated and decoded
    once per worker process: ``moesim.trace.io.iter_steps`` keeps it), the profile already parsed (from the
    object store), the driver's modules and systems of one's own imported and registered (once per process)."""
    import ray

    from moesim.trace.io import keep_decoded
    ray.get(attempts.start.remote(point.point_id))  # noted before the work that may kill this worker
    _register_own(policies)
    keep_decoded(columns)
    return run_point(point, local_copy(trace, ray.get), profile)
