"""Installs a pinned package list of third_party/ from PyPI into the build cache, once, and
prints the folder. The cargo build (build/toolchain.rs) and the CMake build (CMakeLists.txt)
both call it, so that they share the folder.

    python3 third_party/provision.py cuda-toolchain.txt|cutlass.txt [--no-deps]
"""

import os
import subprocess
import sys
from pathlib import Path


def fnv1a(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def cache_dir() -> Path:
    if os.environ.get("MOE_ROUTING_CACHE"):
        return Path(os.environ["MOE_ROUTING_CACHE"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "moe-routing"
    return Path(os.environ.get("HOME", "/tmp")) / ".cache/moe-routing"


def main() -> None:
    name, no_deps = sys.argv[1], "--no-deps" in sys.argv[2:]
    text = (Path(__file__).resolve().parent / name).read_text()
    pins = [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith("#")]
    key = fnv1a("\n".join(pins).encode())
    stem = name[: -len(".txt")] if name.endswith(".txt") else name
    target = cache_dir() / f"{stem}-{key:016x}"
    if not (target / ".complete").exists():
        print(f"moe-routing: installing {' '.join(pins)} from PyPI into {target} (once)",
              file=sys.stderr)
        staging = target.with_name(f"{target.name}.partial-{os.getpid()}")
        staging.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
               "--no-warn-script-location", "--target", str(staging)]
        if no_deps:
            cmd.append("--no-deps")
        if subprocess.run(cmd + pins).returncode != 0:
            sys.exit(f"pip could not install {pins}; set CUDA_HOME / CUTLASS_DIR to existing "
                     f"installs instead")
        (staging / ".complete").write_text("\n".join(pins))
        try:  # another build may have finished first: keep whichever landed
            staging.rename(target)
        except OSError:
            subprocess.run(["rm", "-rf", str(staging)])
    print(target)


if __name__ == "__main__":
    main()
