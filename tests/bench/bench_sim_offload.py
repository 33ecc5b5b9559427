#!/usr/bin/env python3
"""Offload on a fast device, simulated: the GPU check's training shapes on `device.simulate`.

    tests/bench/bench_sim_offload.py build/tools/strata [--preset h200] [--steps 12] [--rounds 1]
                                [--models gpt2,llama] [--llama-layers 8] [--set key=value ...]
                                [--profile FILE] [--fastest] [--no-ratio]

The CPU backend with a simulated device (docs/ARCHITECTURE.md, "A fast device, simulated"):
every kernel takes the preset GPU's modeled time, while copies, the CPU optimizer, the tiers
and I/O are real. So the GPU's regime -- compute far faster than the host's optimizer -- shows
on any machine: the rows below are those the GPU check trains, with the optimizer state in
host RAM and gradient clipping 1.0, the norm simulated under (0.5) and over (3.0) it.

Per model it runs, alternated within each round: everything on the device (the all-on-device
step), then the placement with each exact schedule strata chooses among at that norm -- under
0.5: stepped under backward (strata.optimizer.speculate always), under the next forward or
after backward (never, with strata.optimizer.defer always or never); over it: under the next forward (strata.optimizer.defer always) or after backward
(never) -- and the plain schedule (strata.optimizer.overlap false: its optimizer time is the
optimizer alone). The "auto" defaults time these on a run's first steps and keep the faster.
It prints per row the medians of the steps after the first three (step, forward+backward,
optimizer; 12 steps by default: a run under backward makes its undo room ready over its first
steps), step / max(all-on-device step, optimizer alone) (the line being 1.10), and the
plain schedule's step over the row's. Losses are not real on a
simulated device; the bit-identity of the schedules is the tests' (schedule_fuzz_test).

Beside each row, what `strata plan --config` predicts for the same config (the simulated
device's rates for compute, the host's profile -- `strata probe`, run at the start of each round
unless --profile names one, since a shared or virtual machine's rates drift -- for the CPU
optimizer and the copies; with --fastest each rate from its fastest pass, the host's
capability when other work shares it): "planner ms", the median over the rounds of the step of
the schedule the row runs (TimeTerms::expected_s), and measured / planned, the median over the
rounds of each round's step against that round's plan. Then, unless --no-ratio, per norm the
zero_optimization.offload_optimizer.ratio the planner recommends for the placement (the least
optimizer state on the device whose expected step is within 5% of the fastest) run with the
"auto" schedules: its step against max(all on the device, optimizer alone) and the plain one.

The Llama is TinyLlama-1.1B's layer shape (width 2048, 32/4 heads, SwiGLU 5632, vocab 32000,
4 x 2048 tokens, recomputed activations) with --llama-layers of its 22 layers (default 8, so
that its host-RAM state fits a 24 GiB machine; 22 needs ~30 GiB).
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

GPT2 = {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50257,
        "padded_vocab_size": 50304, "context": 1024}


def llama(layers):
    return {"type": "llama", "n_layer": layers, "n_head": 32, "num_key_value_heads": 4,
            "n_embd": 2048, "intermediate_size": 5632, "vocab_size": 32000, "context": 2048,
            "tied_embeddings": False}


def config(model, micro, accum, activations, steps, preset):
    return {
        "train_batch_size": micro * accum, "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum, "steps_per_print": 1, "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW",
                      "params": {"lr": 6e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "none"},
                              "offload_optimizer": {"device": "none"}},
        "model": model,
        "data": {"source": "synthetic", "eval_batches": 0},
        "device": {"backend": "cpu", "simulate": preset},
        "strata": {"activations": activations},
        "train": {"steps": steps, "eval_interval": 0, "seed": 1, "final_checkpoint": False},
    }


def median_after(rows, key, skip=3):
    vals = [r[key] for r in rows[skip:] if key in r]
    return statistics.median(vals) if vals else float("nan")


def run(exe, cfg_path, sets, workdir, name):
    ckpt = os.path.join(workdir, name)
    log = os.path.join(workdir, name + ".jsonl")
    cmd = [exe, "train", "--config", cfg_path, "--quiet",
           "--set", f'train.checkpoint_dir="{ckpt}"', "--set", f'train.log_file="{log}"']
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.stderr.write(out.stdout + out.stderr)
        raise SystemExit(f"{name}: strata train exited {out.returncode}")
    rows = [json.loads(line) for line in open(log) if line.strip()]
    rows = [r for r in rows if "step_s" in r]
    return {k: median_after(rows, k) for k in ("step_s", "fwd_bwd_s", "optimizer_s",
                                                 "tokens_per_s")}


def plan(exe, cfg_path, sets, workdir, name, profile, fastest=False):
    """`strata plan --config` for a row: (expected step s, schedule, the ratio advice or None)."""
    out_json = os.path.join(workdir, name + ".plan.json")
    cmd = [exe, "plan", "--config", cfg_path, "--json", out_json, "--force"]
    if profile:
        cmd += ["--profile", profile]
    if fastest:
        cmd += ["--fastest"]
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.stderr.write(out.stdout + out.stderr)
        raise SystemExit(f"{name}: strata plan exited {out.returncode}")
    rep = json.load(open(out_json))
    opt = next(o for o in rep["options"] if o["name"] == rep["asked"])
    advice = next((a for a in rep["optimizer_ratio_advice"] if a["option"] == rep["asked"]), None)
    return opt["time_s"]["expected"], opt["expected_schedule"], advice


def probe(exe, path):
    """`strata probe --json path`; prints the rates it found."""
    out = subprocess.run([exe, "probe", "--json", path], capture_output=True, text=True)
    if out.returncode != 0:
        sys.stderr.write(out.stdout + out.stderr)
        raise SystemExit(f"strata probe exited {out.returncode}")
    prof = json.load(open(path))
    opt, copy = prof["cpu_optimizer"], prof["host"]
    print(f"host profile: CPU optimizer {opt['params_per_s'] / 1e6:.0f} Mparam/s (fastest "
          f"{max(t['spread']['max'] for t in opt['by_threads']) / 1e6:.0f}), copy "
          f"{copy['copy_gbps']:.1f} GB/s (fastest {copy['copy_spread']['max']:.1f})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("strata")
    ap.add_argument("--preset", default="h200")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--models", default="gpt2,llama")
    ap.add_argument("--llama-layers", type=int, default=8)
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--profile", default="",
                    help="the host's `strata probe --json` profile (default: probe each round)")
    ap.add_argument("--fastest", action="store_true",
                    help="the profile's rates from their fastest passes (strata plan --fastest)")
    ap.add_argument("--no-ratio", action="store_true",
                    help="skip the rows with the planner's offload_optimizer.ratio")
    a = ap.parse_args()
    exe = os.path.abspath(a.strata)
    models = {
        "gpt2": ("GPT-2 124M, 8 x 1024, 2 micro-batches",
                 config(GPT2, 8, 2, "keep", a.steps, a.preset),
                 [("params on the device, optimizer in host RAM", ["none", "cpu"])]),
        "llama": (f"Llama (TinyLlama-1.1B's layers, {a.llama_layers} of 22), 4 x 2048, recompute",
                  config(llama(a.llama_layers), 4, 1, "recompute", a.steps, a.preset),
                  [("params and optimizer in host RAM", ["cpu", "cpu"])]),
    }
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"simulated device: {a.preset}; {a.steps} steps a run, medians of steps 4-{a.steps}")
    with tempfile.TemporaryDirectory(prefix="strata_bench_sim.") as work:
        # The host's rates drift on a shared or virtual machine: without --profile each round
        # probes first, and its rows are planned with that round's profile.
        def round_profile(r):
            if a.profile:
                return os.path.abspath(a.profile)
            path = os.path.join(work, f"profile-{r}.json")
            print(f"round {r + 1}: ", end="")
            probe(exe, path)
            return path
        if a.fastest:
            print("the planner takes each rate's fastest pass")
        for key in a.models.split(","):
            title, cfg, placements = models[key]
            cfg_path = os.path.join(work, key + ".json")
            with open(cfg_path, "w") as f:
                json.dump(cfg, f)
            # Per norm, the exact schedules strata chooses among (strata.optimizer.speculate
            # and defer "auto" time them on the run's first steps and keep the faster).
            schedules = {
                0.5: [("under backward", ["strata.optimizer.speculate=\"always\""]),
                      ("next forward", ["strata.optimizer.speculate=\"never\"",
                                        "strata.optimizer.defer=\"always\""]),
                      ("after backward", ["strata.optimizer.speculate=\"never\"",
                                          "strata.optimizer.defer=\"never\""]),
                      ("plain", ["strata.optimizer.overlap=false"])],
                3.0: [("next forward", ["strata.optimizer.defer=\"always\""]),
                      ("after backward", ["strata.optimizer.defer=\"never\""]),
                      ("plain", ["strata.optimizer.overlap=false"])],
            }
            results = {}
            planned = {}  # row -> [(expected s, schedule, advice) per round]
            ratios = {}

            def plan_rows(r, profile):
                """Every row's plan at this round's profile; the first round also asks the
                planner for each norm's optimizer ratio and adds its row."""
                def add(row, sets, name):
                    planned.setdefault(row, []).append(
                        plan(exe, cfg_path, sets + a.sets, work, f"{key}-{r}-{name}", profile,
                             a.fastest))
                add("device", [], "device")
                for pname, (pdev, odev) in placements:
                    for norm, scheds in schedules.items():
                        place = [f'zero_optimization.offload_param.device="{pdev}"',
                                 f'zero_optimization.offload_optimizer.device="{odev}"',
                                 f"device.simulate_grad_norm={norm}"]
                        if r == 0 and not a.no_ratio:
                            _, _, advice = plan(exe, cfg_path, place + a.sets, work,
                                                f"{key}-{norm}-ratio", profile, a.fastest)
                            if advice and advice["ratio"] < 1:
                                rs = [f"zero_optimization.offload_optimizer.ratio="
                                      f"{advice['ratio']}"]
                                scheds.append((f"auto, ratio {advice['ratio']:g}", rs))
                                ratios[(pname, norm)] = advice
                        for sname, sets in scheds:
                            add((pname, norm, sname), place + sets,
                                f"{norm}-{sname.replace(' ', '_').replace(',', '')}")
            for r in range(a.rounds):
                plan_rows(r, round_profile(r))
                jobs = [("device", [])]
                for pname, (pdev, odev) in placements:
                    for norm, scheds in schedules.items():
                        for sname, sets in scheds:
                            jobs.append(((pname, norm, sname), [
                                f'zero_optimization.offload_param.device="{pdev}"',
                                f'zero_optimization.offload_optimizer.device="{odev}"',
                                f"device.simulate_grad_norm={norm}"] + sets))
                for jkey, sets in jobs:
                    name = f"{key}-{r}-" + ("device" if jkey == "device" else
                                            f"{jkey[1]}-{jkey[2].replace(' ', '_')}")
                    results.setdefault(jkey, []).append(run(exe, cfg_path, sets + a.sets,
                                                            work, name))
            # Per row: the median of the rounds' planned steps, and of the rounds' measured
            # over planned (each round's runs against that round's plan).
            def planner(row):
                steps = [p[0] for p in planned[row]]
                over = [m["step_s"] / p[0] for m, p in zip(results[row], planned[row])]
                return statistics.median(steps), planned[row][0][1], statistics.median(over)
            med = {k: {m: statistics.median(x[m] for x in v) for m in v[0]}
                   for k, v in results.items()}
            dev = med["device"]["step_s"]
            print(f"\n{title}: all on the device {dev * 1e3:.0f} ms a step (planner "
                  f"{planner('device')[0] * 1e3:.0f} ms)")
            print("| placement | norm | optimizer runs | step ms | fwd+bwd ms | optimizer ms | "
                  "step / max(device, opt alone) | plain / step | planner ms (schedule) | "
                  "measured / planned |")
            print("|---|---|---|---|---|---|---|---|---|---|")
            for pname, _ in placements:
                for norm, scheds in schedules.items():
                    alone = med[(pname, norm, "plain")]["optimizer_s"]
                    plain = med[(pname, norm, "plain")]["step_s"]
                    for sname, _ in scheds:
                        m = med[(pname, norm, sname)]
                        ratio = m["step_s"] / max(dev, alone)
                        pl_s, pl_sched, over = planner((pname, norm, sname))
                        print(f"| {pname} | {norm} | {sname} | {m['step_s'] * 1e3:.0f} | "
                              f"{m['fwd_bwd_s'] * 1e3:.0f} | {m['optimizer_s'] * 1e3:.0f} | "
                              f"{ratio:.2f} | {plain / m['step_s']:.2f}x | "
                              f"{pl_s * 1e3:.0f} ({pl_sched}) | {over:.2f} |")
            for (pname, norm), adv in ratios.items():
                print(f"ratio advice, {pname} at {norm}: {adv['ratio']:g} (expected "
                      f"{adv['expected_s'] * 1e3:.0f} ms {adv['schedule']}, CPU optimizer "
                      f"{adv['cpu_optimizer_s'] * 1e3:.0f} ms, compute {adv['compute_s'] * 1e3:.0f}"
                      f" ms; at ratio 1 {adv['step_at_ratio_1_s'] * 1e3:.0f}, fastest "
                      f"{adv['fastest_s'] * 1e3:.0f} at {adv['fastest_ratio']:g})")


if __name__ == "__main__":
    main()
