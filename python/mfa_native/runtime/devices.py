"""Choosing the device a call runs on, and the facts codegen tunes for."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterator

from .. import _core
from ..codegen.kernel import tuned
from ..codegen.kernel.tables import table_family

Device = _core.Device


def devices() -> list[Device]:
    """Every device available here: metal (on a Mac with Apple silicon) and cpu.

    Returns:
        A list of Device, metal first where present; the cpu device is always there.

    Example:
        ```python
        import mfa_native

        kinds = [device.kind for device in mfa_native.devices()]
        print(kinds)   # ['metal', 'cpu'] on a Mac, ['cpu'] elsewhere
        assert "cpu" in kinds
        ```
    """
    return _core.devices()


def default_device() -> Device:
    """The device the ops run on when not given one: MFA_NATIVE_DEVICE=cpu|metal when set,
    else metal where available, else cpu.

    Returns:
        A Device.

    Raises:
        DeviceUnavailableError: MFA_NATIVE_DEVICE=metal where Metal is not available.
        ValueError: MFA_NATIVE_DEVICE is set to something else than cpu or metal.

    Example:
        ```python
        import mfa_native

        device = mfa_native.default_device()
        print(device.kind, device.name)
        assert device in mfa_native.devices()
        ```
    """
    return _core.default_device()


def resolve_device(device: Device | str | None) -> Device:
    """None -> the default device; 'cpu' / 'metal' -> that device; a Device as is."""
    if device is None:
        return default_device()
    if isinstance(device, str):
        if device not in ("cpu", "metal"):
            raise ValueError(f"device must be 'cpu', 'metal', a Device or None, got {device!r}")
        return _core.get_device(device)
    if isinstance(device, Device):
        return device
    raise TypeError(f"device must be 'cpu', 'metal', a Device or None, got {type(device).__name__}")


@dataclass(frozen=True)
class TuningFacts:
    """What codegen tunes for: the family name codegen takes, about how many threadgroups
    the device runs at once (decode splits the keys to fill it), and whether it may write Metal 4
    tensor-op kernels for the device (`tensor_ops`: an M5 on macOS 26.2 or later, unless
    MFA_NATIVE_TENSOR_OPS=off; the cpu device only with MFA_NATIVE_TENSOR_OPS=on). A device's
    family carries its tuned table (`apple9@Apple-M3-Max-40-GPU-cores`: codegen/kernel/tuned.py
    device_family), so lookups for it read that device's table and no other."""

    family: str
    parallel_threadgroups: int
    tensor_ops: bool


_tuning: dict[Device, TuningFacts] = {}


def forget_tuning() -> None:
    """Drops the tuning facts read so far (and the Device objects they are keyed by)."""
    _tuning.clear()


def tuning_facts(device: Device) -> TuningFacts:
    """The typed tuning facts the device's backend reports, read once per device; its family is
    the one whose tables it runs (tables.table_family: apple10's tensor-op rows only with tensor ops)."""
    facts = _tuning.get(device)
    if facts is None:
        reported = device.tuning
        family = table_family(reported.family, reported.tensor_ops)
        facts = _tuning[device] = TuningFacts(tuned.device_family(family, reported.model),
                                              reported.parallel_threadgroups, reported.tensor_ops)
    return facts


@contextmanager
def tuned_as(device: Device, **facts) -> Iterator[TuningFacts]:
    """Inside the block, `device` reports these tuning facts (fields of TuningFacts) instead of
    its own: tests and benchmarks use it to make one device choose what another would
    (say, a split-KV decode on a device with room for 64 threadgroups). A family is taken as
    given: a plain one ("apple7") has only its built-in rows, a device family
    (tuned.device_family) that device's tuned table, a forced one (tables.forced_rows) its rows."""
    own = tuning_facts(device)
    _tuning[device] = replace(own, **facts)
    try:
        yield _tuning[device]
    finally:
        _tuning[device] = own
