"""The env phase (the GPU, driver, toolkit and tools on this machine) and the build phase."""
import os
import re
import shutil
import subprocess
import time

from .common import ROOT, find_tool, hbm_gbs_for, pcie_lane_gbps, peak_for

BUILD_TARGETS = ["strata", "bench_device_ops", "cuda_backend_test", "cuda_train_test",
                 "cuda_flash_attention_test", "llama_cuda_test", "flash_attention_test"]


def _dev_sh_packages():
    """The packages tools/dev.sh deps installs (one list, read from there)."""
    try:
        text = (ROOT / "tools" / "dev.sh").read_text()
    except OSError:
        return []
    m = re.search(r"^PKGS=\((.*?)\)", text, re.S | re.M)
    if not m:
        return []
    body = re.sub(r"#[^\n]*", "", m.group(1))
    return body.split()


def _installed(pkg):
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return True
    return "install ok installed" in out


def _mem_gib():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    return "%.0f GiB" % (int(line.split()[1]) / 1048576)
    except OSError:
        pass
    return "?"


def phase_env(ctx):
    o = ctx.opts
    smi = find_tool("nvidia-smi")
    name = cc = driver = mem = clock = gen = width = cuda_drv = ""
    if smi:
        rc, out = ctx.capture(30, [smi, "--query-gpu=name,compute_cap,driver_version,memory.total,"
                                   "clocks.max.sm,pcie.link.gen.max,pcie.link.width.max",
                                   "--format=csv,noheader,nounits"])
        ctx.log(out)
        line = out.strip().splitlines()[0] if out.strip() else ""
        fields = [x.strip() for x in line.split(",")] + [""] * 7
        name, cc, driver, mem, clock, gen, width = fields[:7]
        rc, full = ctx.capture(30, [smi])
        ctx.log("\n".join(full.splitlines()[:20]))
        m = re.search(r"CUDA Version:\s*([0-9.]+)", full)
        cuda_drv = m.group(1) if m else ""
    nvcc = find_tool(os.environ.get("CUDACXX", ""), "/usr/local/cuda/bin/nvcc", "nvcc",
                     *sorted(_glob("/usr/local/cuda-*/bin/nvcc")))
    nvcc_ver = ""
    if nvcc:
        rc, out = ctx.capture(30, [nvcc, "--version"])
        m = re.search(r"release ([0-9.]+)", out)
        nvcc_ver = m.group(1) if m else ""
    cmake = find_tool("cmake")
    ninja = find_tool("ninja", "ninja-build")
    make = find_tool("make")
    cxx = find_tool(os.environ.get("CXX", ""), "c++", "g++", "clang++")
    sanitizer = find_tool("compute-sanitizer", "/usr/local/cuda/bin/compute-sanitizer",
                          "/usr/local/cuda/compute-sanitizer/compute-sanitizer")
    missing = [p for p in _dev_sh_packages() if shutil.which("dpkg-query") and not _installed(p)]
    arch = o.arch or cc.replace(".", "")
    peak = o.peak_tflops if o.peak_tflops is not None else peak_for(name)
    lane = pcie_lane_gbps(gen)
    link = round(lane * int(width), 1) if lane and width.isdigit() else None
    ctx.state.update({"gpu_name": name, "gpu_cc": cc, "arch": arch, "peak_tflops": peak,
                      "peak_gbs": hbm_gbs_for(name),
                      "nvcc": nvcc, "cmake": cmake, "ninja": ninja, "make": make, "cxx": cxx,
                      "sanitizer": sanitizer, "link_gbps": link, "smi": smi})

    def q(x):
        return x if x else "?"
    ctx.md("| item | value |")
    ctx.md("|---|---|")
    ctx.md("| GPU | %s (compute capability %s, %s MiB, max SM clock %s MHz) |"
           % (name or "none found", q(cc), q(mem), q(clock)))
    ctx.md("| driver | %s (supports CUDA %s) |" % (q(driver), q(cuda_drv)))
    ctx.md("| host link | PCIe gen %s x%s = %s GB/s per direction |" % (q(gen), q(width), q(link)))
    ctx.md("| build for | sm_%s; dense bf16 peak used: %s TFLOP/s |"
           % (q(arch), peak if peak is not None else "unknown"))
    ctx.md("| toolkit | nvcc %s (%s) |" % (nvcc_ver or "not found", nvcc))
    ctx.md("| tools | cmake: %s; ninja: %s; make: %s; C++: %s; compute-sanitizer: %s |"
           % (cmake or "MISSING", ninja or "missing", make or "missing", cxx or "MISSING",
              sanitizer or "MISSING"))
    ctx.md("| CPU | %d cores; %s RAM |" % (os.cpu_count() or 0, _mem_gib()))
    ctx.md("| missing packages | %s |" % (" ".join(missing) or "none"))
    problems = []
    if not name and not ctx.dry:
        problems.append("no NVIDIA GPU (nvidia-smi %s)" % (smi or "not found"))
    # The build's tools and packages matter only to a run that builds (tools/gpu_bundle.sh carries
    # binaries built elsewhere: a machine without them is no failure).
    if "build" in ctx.selected:
        if not nvcc:
            problems.append("no nvcc")
        if not cmake:
            problems.append("no cmake")
        if not cxx:
            problems.append("no C++ compiler")
        if not ninja and not make:
            problems.append("neither ninja nor make")
        if missing:
            problems.append("missing packages: %s (tools/dev.sh deps needs network)"
                            % " ".join(missing))
    if cuda_drv and nvcc_ver and int(cuda_drv.split(".")[0]) < int(nvcc_ver.split(".")[0]):
        problems.append("the driver supports CUDA %s but nvcc is %s: binaries will fail with "
                        "cudaErrorInsufficientDriver" % (cuda_drv, nvcc_ver))

    def num(x):
        try:
            return float(x) if "." in x else int(x)
        except (TypeError, ValueError):
            return None
    ctx.put_json({"gpu": name, "compute_capability": cc, "driver": driver,
                  "driver_cuda": cuda_drv, "memory_mib": num(mem), "max_sm_clock_mhz": num(clock),
                  "pcie_gen": num(gen), "pcie_width": num(width),
                  "link_gbps_per_direction": link, "arch": arch, "peak_bf16_tflops": peak,
                  "nvcc": nvcc_ver, "compute_sanitizer": sanitizer, "cores": os.cpu_count(),
                  "missing_packages": " ".join(missing), "dry_run": ctx.dry})
    if problems:
        ctx.result("failed", "; ".join(problems))
    else:
        ctx.result("ok", "%s, sm_%s, driver %s, nvcc %s" % (name or "no GPU (dry run)", q(arch),
                                                           q(driver), q(nvcc_ver)))


def _glob(pattern):
    import glob
    return glob.glob(pattern)


def phase_build(ctx):
    st = ctx.state
    gen = "Ninja" if st.get("ninja") else ("Unix Makefiles" if st.get("make") else "")
    arch = st.get("arch") or "90"
    args = ["-S", str(ROOT), "-B", str(ctx.build), "-DCMAKE_BUILD_TYPE=Release",
            "-DSTRATA_WITH_CUDA=ON", "-DSTRATA_BUILD_BENCHMARKS=OFF",
            "-DSTRATA_CUDA_ARCHITECTURES=%s" % arch]
    if gen:
        args += ["-G", gen]
    if st.get("nvcc"):
        args.append("-DCMAKE_CUDA_COMPILER=%s" % st["nvcc"])
    if shutil.which("ccache"):
        args += ["-DCMAKE_CXX_COMPILER_LAUNCHER=ccache", "-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache"]
    jobs = ctx.opts.jobs
    ctx.md("configure: `cmake %s`" % " ".join(args))
    ctx.md("")
    ctx.md("build: `cmake --build %s -j %d --target %s`" % (ctx.build, jobs, " ".join(BUILD_TARGETS)))
    cmake = st.get("cmake")
    if ctx.dry:
        # The commands exist and the build directory holds what later phases run.
        missing = ([] if cmake else ["cmake"]) + ([] if gen else ["ninja or make"])
        missing += [str(ctx.bin(b)) for b in ("strata", "bench_device_ops")
                    if not os.access(ctx.bin(b), os.X_OK)]
        if missing:
            ctx.result("failed", "dry run: missing %s" % " ".join(missing))
        else:
            ctx.result("ok", "dry run: not built; cmake and %s found, %s has the binaries"
                       % (gen, ctx.build))
        return
    if not cmake:
        return ctx.result("failed", "cmake not found")
    if not gen:
        return ctx.result("failed", "neither ninja nor make found")
    if not st.get("nvcc"):
        return ctx.result("failed", "nvcc not found: the CUDA backend cannot be built")
    t0 = time.time()
    if ctx.run(600, [cmake] + args) != 0:
        return ctx.result("failed", "cmake configure failed (see logs/build.log; missing packages "
                          "are listed under env)")
    t1 = time.time()
    if ctx.run(900, [cmake, "--build", ctx.build, "-j", jobs, "--target"] + BUILD_TARGETS) != 0:
        return ctx.result("failed", "build failed after %d s (see logs/build.log)" % (time.time() - t1))
    ctx.md("")
    ctx.md("configure %d s, build %d s with %d jobs." % (t1 - t0, time.time() - t1, jobs))
    ctx.put_json({"generator": gen, "arch": arch, "configure_s": int(t1 - t0),
                  "build_s": int(time.time() - t1), "jobs": jobs})
    ctx.result("ok", "sm_%s with %s in %d s" % (arch, gen, time.time() - t0))
