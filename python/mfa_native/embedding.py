"""Where the installed package keeps the C++ core, for programs that embed it."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def include_dir() -> str:
    """The directory holding mfa/*.hpp (the public C++ API)."""
    return str(_HERE / "include")


def library_path() -> str:
    """The static core library, libmfa_core.a."""
    return str(_HERE / "lib" / "libmfa_core.a")


def cmake_dir() -> str:
    """The folder holding mfa_nativeConfig.cmake, for a C++ program that embeds the core.

    Pass it to CMake as mfa_native_DIR (`cmake -Dmfa_native_DIR=$(python -c "import mfa_native;
    print(mfa_native.cmake_dir())")`), and find_package(mfa_native CONFIG REQUIRED) gives the
    target mfa_native::core.

    Returns:
        The absolute path, a str, inside the installed package.

    Example:
        ```python
        import os
        import mfa_native

        print(mfa_native.cmake_dir())
        assert os.path.isfile(os.path.join(mfa_native.cmake_dir(), "mfa_nativeConfig.cmake"))
        ```
    """
    return str(_HERE / "lib" / "cmake" / "mfa_native")


def cpp_flags() -> str:
    """Compiler and linker flags for a C++17 program that embeds the core, e.g.
    ``g++ -std=c++17 main.cpp $(python -c "import mfa_native; print(mfa_native.cpp_flags())")``.

    Returns:
        One str: the include directory (-I), the static core library, -pthread, and the
            system libraries (-ldl on Linux; the Metal, Foundation, IOKit and
            CoreFoundation frameworks on macOS).

    Example:
        ```python
        import mfa_native

        flags = mfa_native.cpp_flags()
        print(flags)   # -I.../mfa_native/include .../libmfa_core.a -pthread ...
        assert flags.startswith("-I") and "libmfa_core.a" in flags
        ```
    """
    system = ["-framework Metal -framework Foundation -framework IOKit -framework CoreFoundation"] \
        if sys.platform == "darwin" else ["-ldl"]
    return " ".join([f"-I{include_dir()}", library_path(), "-pthread", *system])
