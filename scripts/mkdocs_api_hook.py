"""MkDocs hook (mkdocs.yml `hooks:`): on an API page, the line `::: MODULE` becomes the module's
docstring and then one entry per name of the module's `__all__`, in its order, so the reference
shows exactly the public names (a class's members are then filtered by name: no `_private`
and no `__dunder__`, which inspection would otherwise list). A public submodule in `__all__` gets
a link to its own page, `api/NAME.md`."""

from __future__ import annotations

import importlib
import inspect
import re

DIRECTIVE = re.compile(r"^::: (mfa_native[\w.]*)[ \t]*$", re.M)


def _entries(match: re.Match) -> str:
    module_name = match[1]
    module = importlib.import_module(module_name)
    parts = [f"::: {module_name}\n    options:\n      members: false\n      show_root_heading: false"]
    for name in module.__all__:
        if inspect.ismodule(getattr(module, name)):
            parts.append(f"## `{module_name}.{name}`\n\nA module of its own: [`{module_name}.{name}`]({name}.md).")
        else:
            parts.append(f"::: {module_name}.{name}")
    return "\n\n".join(parts)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if not page.file.src_uri.startswith("api/"):
        return markdown
    return DIRECTIVE.sub(_entries, markdown)
