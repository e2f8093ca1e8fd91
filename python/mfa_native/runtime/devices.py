"""Choosing the device a call runs on."""

from __future__ import annotations

from . import _core

Device = _core.Device


def devices() -> list[Device]:
    """Every device available here: metal (on a Mac with Apple silicon) and cpu."""
    return _core.devices()


def default_device() -> Device:
    """MFA_NATIVE_DEVICE=cpu|metal when set, else metal where available, else cpu."""
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
