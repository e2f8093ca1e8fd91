"""Tuned tile rows: the per-device table `python -m mfa_native tune` writes, which
tables.tile_row and tables.backward_tile_row consult before their built-in rows.

Which table: a device's tuning facts (runtime/devices.tuning_facts) name its family
`<family>@<table>` (device_family): the family carries the device's table, named after its
model (Device.tuning.model, e.g. "Apple M3 Max, 40 GPU cores" -> "Apple-M3-Max-40-GPU-cores";
the cpu backend's is "cpu"), so an M3 Pro and an M3 Max, one family, keep tables of their own.
A plain family name (codegen's default, `emit --family`, `tuned_as(device, family="apple7")`)
has no table: its built-in rows.

Where: MFA_NATIVE_TUNING unset: `<cache>/tuning/<table>.json` (cache: MFA_NATIVE_CACHE_DIR,
else $XDG_CACHE_HOME/mfa_native, else ~/.cache/mfa_native; ~/Library/Caches/mfa_native on
macOS); `off`: no tuned table, the built-in rows; any other value: a directory holding the
`<table>.json` files. A file holds its family, the device it was tuned on, and per direction
("forward", "backward") and input dtype ("float32", "float16", "bfloat16") rows with every
column of the direction's row type; a tuned row replaces the built-in row of its dtype's table
with the same max_head_dim (the range it was tuned for). A damaged file (or one of another
family, or of an older format: format 1 rows were not keyed by dtype) is ignored with a warning
(the built-in rows apply; `tune` rewrites it). The per-family files of earlier versions (`<family>.json`) are not read, with no
warning: a family's GPUs differ in cores and so in their best rows; run `tune` again.
"""

from __future__ import annotations

import json
import os
import re
import sys
import warnings
from dataclasses import asdict, fields
from pathlib import Path

ENV = "MFA_NATIVE_TUNING"
FORMAT = 2   # 2: rows keyed by direction, then dtype
DIRECTIONS = ("forward", "backward")
TABLE_MARK = "@"   # family TABLE_MARK table: a device's family name

_loaded: dict[str, dict[str, dict[str, list[dict]]] | None] = {}   # device family -> rows by direction, dtype (None: none)
_generation = [0]


def table_name(model: str) -> str:
    """The file name (without .json) of a device model's table: runs of characters other than
    letters, digits, '.', '_' and '-' become one '-'."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip("-.")
    if not name:
        raise ValueError(f"model must name a device (letters or digits), got {model!r}")
    return name


def device_family(family: str, model: str) -> str:
    """The family name codegen takes for a device of `model`: `family` carrying the model's table."""
    return f"{family}{TABLE_MARK}{table_name(model)}"


def parts(family: str) -> tuple[str, str | None]:
    """(family, table name) of a device family; (family, None) for a plain family name."""
    base, mark, table = family.partition(TABLE_MARK)
    return base, (table if mark else None)


def _cache_directory() -> Path:
    for variable, suffix in (("MFA_NATIVE_CACHE_DIR", ""), ("XDG_CACHE_HOME", "mfa_native")):
        if os.environ.get(variable):
            return Path(os.environ[variable]) / suffix
    home = Path.home()
    return home / "Library" / "Caches" / "mfa_native" if sys.platform == "darwin" else home / ".cache" / "mfa_native"


def directory() -> Path | None:
    """The directory of tuned tables, or None when MFA_NATIVE_TUNING=off."""
    setting = os.environ.get(ENV, "")
    if setting == "off":
        return None
    return Path(setting) if setting else _cache_directory() / "tuning"


def setting() -> str:
    """MFA_NATIVE_TUNING's value as `info` shows it."""
    return f"{ENV}={os.environ.get(ENV) or '(unset)'}"


def table_path(family: str) -> Path | None:
    """The file a device family's tuned table is read from and written to (None: tuning off,
    or a plain family name, which has no table)."""
    where, table = directory(), parts(family)[1]
    return None if where is None or table is None else where / f"{table}.json"


def generation() -> int:
    """Changes whenever the rows a lookup may return change (the warm path keys on it)."""
    return _generation[0]


def forget() -> None:
    """Drop the tables read so far: the next lookup reads the files (and MFA_NATIVE_TUNING) again."""
    _loaded.clear()
    _generation[0] += 1


def _read(family: str) -> dict[str, dict[str, list[dict]]] | None:
    path, base = table_path(family), parts(family)[0]
    if path is None or not path.exists():
        return None
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(table.get("format"), int) and table["format"] < FORMAT:
            warnings.warn(f"ignoring the tuned table {path}: format {table['format']} is older than {FORMAT} "
                          "(its rows are not keyed by dtype); the built-in rows apply until `tune` rewrites it",
                          stacklevel=5)
            return None
        if table.get("format") != FORMAT or table.get("family") != base:
            raise ValueError(f"format {table.get('format')!r} / family {table.get('family')!r}, "
                             f"expected {FORMAT} / {base!r}")
        return {direction: {dtype: list(rows) for dtype, rows in table.get(direction, {}).items()}
                for direction in DIRECTIONS}
    except (OSError, ValueError, AttributeError, TypeError) as error:
        warnings.warn(f"ignoring the damaged tuned table {path} ({error}); the built-in rows apply", stacklevel=5)
        return None


def _typed(entry: dict, row_type):
    names = {f.name for f in fields(row_type)}
    if not isinstance(entry, dict) or set(entry) != names:
        raise ValueError(f"a row must have exactly the columns {sorted(names)}, got {entry!r}")
    return row_type(**entry)


def _table(family: str) -> dict[str, dict[str, list[dict]]] | None:
    if family not in _loaded:
        _loaded[family] = _read(family)
    return _loaded[family]


def tuned_row(family: str, direction: str, dtype: str, max_head_dim: int, row_type):
    """The tuned `row_type` row of a device family's table for `dtype` inputs and the built-in
    range ending at `max_head_dim`, or None."""
    table = _table(family)
    if table is None:
        return None
    try:
        rows = [_typed(entry, row_type) for entry in table[direction].get(dtype, [])]
    except (ValueError, TypeError) as error:
        warnings.warn(f"ignoring the damaged tuned table {table_path(family)} ({error}); "
                      "the built-in rows apply", stacklevel=3)
        _loaded[family] = None
        return None
    return next((row for row in rows if row.max_head_dim == max_head_dim), None)


def source(family: str) -> str:
    """Which rows lookups for a device family use: "tuned" (its table's, where it has them) or "built-in"."""
    return "built-in" if table_path(family) is None or _table(family) is None else "tuned"


def location(family: str) -> str:
    """Where a device family's tuned table lives and its state, as `info` shows it."""
    path = table_path(family)
    if path is None:
        return f"none ({setting()})" if directory() is None else "none (a family without a device)"
    state = "in use" if _table(family) is not None else "damaged, ignored" if path.exists() else "not written yet"
    return f"{path} ({state}; {setting()})"


def write(family: str, device: str, rows: dict[str, dict[str, list]]) -> Path:
    """Write a device family's tuned table (rows: direction -> dtype -> row dataclasses; `device`:
    the device's name, recorded) where lookups read it, and make later lookups use it. Raises
    ValueError when tuning is off or `family` names no device."""
    path = table_path(family)
    if path is None:
        raise ValueError(f"{ENV}=off: there is no tuned table to write" if directory() is None else
                         f"family {family!r} names no device (runtime.devices.tuning_facts(device).family does)")
    path.parent.mkdir(parents=True, exist_ok=True)
    table = {"format": FORMAT, "family": parts(family)[0], "device": device,
             **{direction: {dtype: [asdict(row) for row in dtype_rows]
                            for dtype, dtype_rows in rows.get(direction, {}).items()} for direction in DIRECTIONS}}
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    temporary.replace(path)
    forget()
    return path
