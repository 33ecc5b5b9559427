"""DeepSpeed for a GPU machine without network: packed here as wheels (and libaio, for its NVMe
path), installed there into a throwaway virtual environment that sees the machine's own PyTorch
and CUDA (--system-site-packages).

The bundle directory (default build-gpu-bundle/peers, carried with the strata bundle):
  wheels/      deepspeed (built here as a pure-Python wheel: its ops are compiled on first use
               there) and every dependency the machine's PyTorch environment may lack, for
               CPython 3.9-3.13 where a wheel is binary; never torch, never numpy (a PyTorch
               environment has it; the install checks)
  libaio/      lib/libaio.so.1 and lib/libaio.so, include/libaio.h from Debian's libaio1 and
               libaio-dev (DeepSpeed's async I/O op links -laio and includes libaio.h)
  MANIFEST.json  what was packed, from which versions, and the requirement list it satisfies
"""
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import ROOT

DEEPSPEED = "deepspeed==0.19.8"
# DeepSpeed's requirements/requirements.txt less torch and numpy, and nvidia-ml-py (which its
# setup.py adds when it is built with CUDA torch present); pydantic brings pydantic-core,
# annotated-types, typing-extensions and typing-inspection.
REQUIREMENTS = ["einops", "hjson", "msgpack", "ninja", "packaging>=20.0", "psutil", "py-cpuinfo",
                "pydantic>=2.0.0", "tqdm", "nvidia-ml-py"]
PYTHONS = ["3.9", "3.10", "3.11", "3.12", "3.13"]
PLATFORMS = ["manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_5_x86_64", "manylinux1_x86_64"]
LIBAIO_DEBS = ["libaio1", "libaio-dev"]  # Debian bookworm's names (libaio1t64 from trixie)


def default_dir():
    return ROOT / "build-gpu-bundle" / "peers"


def _run(cmd, **kw):
    print("$ " + " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], **kw)


def pack(dest):
    """Downloads the wheels and libaio into dest (here, with network). Returns 0 when complete."""
    dest = Path(dest)
    wheels = dest / "wheels"
    shutil.rmtree(dest, ignore_errors=True)
    wheels.mkdir(parents=True)
    tmp = Path(tempfile.mkdtemp(prefix="gpu_peers_pack."))
    try:
        # DeepSpeed ships only a source archive: built here into a pure-Python wheel (without
        # torch its setup.py pre-compiles no op; the machine compiles CPU Adam and async I/O
        # on first use).
        if _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                 "-d", tmp, DEEPSPEED]).returncode:
            return 1
        sdist = glob.glob(str(tmp / "deepspeed-*.tar.gz"))
        if not sdist or _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", wheels,
                              sdist[0]]).returncode:
            return 1
        # The pure-Python dependencies once, the binary ones per CPython version.
        for py in PYTHONS:
            cmd = [sys.executable, "-m", "pip", "download", "-d", wheels, "--only-binary=:all:",
                   "--python-version", py, "--implementation", "cp"]
            for p in PLATFORMS:
                cmd += ["--platform", p]
            if _run(cmd + REQUIREMENTS).returncode:
                print("gpu_peers pack: the wheels for CPython %s are incomplete" % py)
                return 1
        # The build tools DeepSpeed's JIT needs from Python (setuptools: torch's cpp_extension).
        if _run([sys.executable, "-m", "pip", "download", "-d", wheels, "--only-binary=:all:",
                 "setuptools", "wheel"]).returncode:
            return 1
        if pack_libaio(dest / "libaio", tmp):
            return 1
        manifest = {"magic": "strata-gpu-peers", "version": 1, "deepspeed": DEEPSPEED,
                    "requirements": REQUIREMENTS, "pythons": PYTHONS,
                    "not_carried": ["torch", "numpy (the machine's PyTorch environment's)"],
                    "wheels": sorted(os.path.basename(w) for w in glob.glob(str(wheels / "*"))),
                    "libaio": sorted(str(p.relative_to(dest)) for p in (dest / "libaio").rglob("*")
                                     if p.is_file())}
        (dest / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print("gpu_peers: %s (%.1f MB): %d wheels, libaio" % (dest, size / 1e6, len(manifest["wheels"])))
    return 0


def pack_libaio(out, tmp):
    """libaio's shared library and header from Debian's packages (apt-get download: no root)."""
    debs = tmp / "debs"
    debs.mkdir()
    for name in LIBAIO_DEBS:
        if _run(["apt-get", "download", name], cwd=debs).returncode:
            print("gpu_peers pack: apt-get download %s failed" % name)
            return 1
    root = tmp / "root"
    for deb in glob.glob(str(debs / "*.deb")):
        if _run(["dpkg-deb", "-x", deb, root]).returncode:
            return 1
    (out / "lib").mkdir(parents=True)
    (out / "include").mkdir(parents=True)
    libs = [p for p in root.rglob("libaio.so.1*") if p.is_file() and not p.is_symlink()]
    heads = list(root.rglob("libaio.h"))
    if not libs or not heads:
        print("gpu_peers pack: no libaio.so.1 or libaio.h in the packages")
        return 1
    # Plain files, no links (the carried folder keeps files): the soname and the link name.
    shutil.copyfile(libs[0], out / "lib" / "libaio.so.1")
    shutil.copyfile(libs[0], out / "lib" / "libaio.so")
    shutil.copyfile(heads[0], out / "include" / "libaio.h")
    return 0


def _missing_requirements(python, extra_ok=()):
    """Requirements of the installed distributions that nothing installed satisfies, as pip
    check reports them, less the ones named in extra_ok (supplied by the machine)."""
    p = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True)
    lines = [l for l in (p.stdout + p.stderr).splitlines() if l.strip() and "No broken" not in l]
    return [l for l in lines if not any((" %s" % n) in l.lower() for n in extra_ok)]


def install(peers, venv, base_python=None, log=print):
    """Installs DeepSpeed from the bundle into a new virtual environment at venv that sees the
    site packages of base_python (default: this interpreter), its PyTorch and CUDA, with no
    network. Returns (python, error).

    --system-site-packages shows the base interpreter's packages, which is not enough where the
    PyTorch environment is itself a virtual environment (a venv made from a venv sees the
    interpreter's, not the outer venv's): a .pth file adds base_python's own site directories,
    after the new environment's (DeepSpeed's dependencies from the bundle come first)."""
    peers, venv = Path(peers), Path(venv)
    base = str(base_python or sys.executable)
    wheels = peers / "wheels"
    if not wheels.is_dir():
        return None, "no %s (pack it with tools/gpu_peers.py pack)" % wheels
    shutil.rmtree(venv, ignore_errors=True)
    r = _run([base, "-m", "venv", "--system-site-packages", venv], capture_output=True, text=True)
    if r.returncode:
        return None, "%s -m venv failed: %s" % (base, (r.stdout + r.stderr).strip()[-300:])
    python = venv / "bin" / "python"
    code = ("import site, sys, json; p = site.getsitepackages() + "
            "([site.getusersitepackages()] if site.ENABLE_USER_SITE else []); "
            "print(json.dumps([x for x in p + sys.path if x.endswith(('site-packages', "
            "'dist-packages'))]))")
    try:
        dirs = json.loads(subprocess.run([base, "-c", code], capture_output=True, text=True,
                                         timeout=60).stdout)
        purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig."
                                  "get_paths()['purelib'])"], capture_output=True, text=True,
                                 timeout=60).stdout.strip()
        seen = []
        for d in dirs:
            if d not in seen and os.path.isdir(d):
                seen.append(d)
        Path(purelib, "_strata_gpu_peers_base.pth").write_text("\n".join(seen) + "\n")
        log("site directories of %s added: %s" % (base, seen))
    except (OSError, ValueError, subprocess.TimeoutExpired) as e:
        log("the base interpreter's site directories were not added: %s" % e)
    r = _run([python, "-m", "pip", "install", "--no-index", "--find-links", wheels,
              "--disable-pip-version-check", "deepspeed"], capture_output=True, text=True)
    log(r.stdout + r.stderr)
    if r.returncode:
        return None, "pip install --no-index deepspeed failed: %s" % r.stderr.strip()[-300:]
    return python, ""


def verify(peers):
    """Here, without torch: installs the bundle's wheels for this Python into a throwaway
    venv with torch and numpy stood in by empty distributions (metadata only), so the resolver
    must find every other requirement of DeepSpeed in the bundle (--no-index); then pip check.
    Returns 0 when the wheel set is complete for this Python."""
    peers = Path(peers)
    tmp = Path(tempfile.mkdtemp(prefix="gpu_peers_verify."))
    try:
        venv = tmp / "venv"
        if _run([sys.executable, "-m", "venv", venv]).returncode:
            return 1
        python = venv / "bin" / "python"
        site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                               "['purelib'])"], capture_output=True, text=True).stdout.strip()
        have = subprocess.run([sys.executable, "-c", "import importlib.util as u; "
                               "print(u.find_spec('torch') is not None)"],
                              capture_output=True, text=True).stdout.strip() == "True"
        if not have:
            for name, version in (("torch", "2.9.0"), ("numpy", "2.1.0")):
                info = Path(site) / ("%s-%s.dist-info" % (name, version))
                info.mkdir()
                (info / "METADATA").write_text("Metadata-Version: 2.1\nName: %s\nVersion: %s\n"
                                               % (name, version))
                (info / "INSTALLER").write_text("gpu_peers verify (a stand-in)\n")
                (info / "RECORD").write_text("")
        r = _run([python, "-m", "pip", "install", "--no-index", "--find-links", peers / "wheels",
                  "--disable-pip-version-check", "deepspeed"])
        if r.returncode:
            print("gpu_peers verify: the wheel set is incomplete for Python %d.%d"
                  % sys.version_info[:2])
            return 1
        broken = _missing_requirements(python)
        if broken:
            print("gpu_peers verify: pip check: " + "; ".join(broken))
            return 1
        r = _run([python, "-c", "import hjson, msgpack, ninja, cpuinfo, pydantic, psutil, tqdm, "
                  "einops, packaging; print('imports ok')"])
        if r.returncode:
            return 1
        # The dependency wheels of every other CPython version are present too.
        names = [w.lower() for w in os.listdir(peers / "wheels")]
        for py in PYTHONS:
            tag = "cp" + py.replace(".", "")
            for dist in ("pydantic_core", "msgpack"):
                if not any(n.startswith(dist) and (("-%s-" % tag) in n or "abi3" in n)
                           for n in names):
                    print("gpu_peers verify: no %s wheel for CPython %s" % (dist, py))
                    return 1
        lib = peers / "libaio" / "lib" / "libaio.so.1"
        if not lib.is_file() or not (peers / "libaio" / "include" / "libaio.h").is_file():
            print("gpu_peers verify: libaio is missing from %s" % peers)
            return 1
        import ctypes
        ctypes.CDLL(str(lib))
        print("gpu_peers verify: OK (deepspeed and its requirements install from the bundle "
              "alone on Python %d.%d; the binary wheels are there for CPython %s; libaio "
              "loads)" % (sys.version_info[:2] + (", ".join(PYTHONS),)))
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv):
    import argparse
    p = argparse.ArgumentParser(prog="tools/gpu_peers.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["pack", "verify"])
    p.add_argument("--dir", default=str(default_dir()),
                   help="the bundle directory (default: build-gpu-bundle/peers)")
    a = p.parse_args(argv)
    if a.command == "pack":
        rc = pack(a.dir)
        return rc or verify(a.dir)
    return verify(a.dir)
