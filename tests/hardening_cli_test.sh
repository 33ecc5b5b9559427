#!/usr/bin/env bash
# Adversarial cases that need the strata binary: exit codes and messages for inputs that used
# to crash or pass silently, and Ctrl-C under a real `mpirun -np 2` (Open MPI sends each rank
# SIGCONT, SIGTERM 1 s later, SIGKILL 1 s after that): every rank finishes its step, the
# checkpoint is written, the swap files are removed, and --resume continues; settings that
# make mpirun's ranks train alone (strata.comm.backend single, device.simulate), named.
# usage: hardening_cli_test.sh STRATA_BINARY REPO_DIR [MPIEXEC]
set -uo pipefail
strata=$1
repo=$2
mpiexec=${3:-}
# shellcheck source=tests/cli_lib.sh
. "$(dirname "$0")/cli_lib.sh"
cd "$work"
mkdir -p swap
common=(--config "$repo/configs/tiny-cpu.json" --set 'train.checkpoint_dir="ck"'
        --set 'zero_optimization.offload_optimizer.nvme_path="swap"' --set train.eval_interval=0
        --set scheduler.params.warmup_num_steps=2)

# Metrics on a full file system: training finishes and saves, the exit status says it.
"$strata" train "${common[@]}" --set train.steps=2 --set 'train.log_file="/dev/full"' \
  >full.txt 2>&1
rc=$?
check "/dev/full metrics log exits 1" test "$rc" -eq 1
check "/dev/full names train.log_file" grep -q "train.log_file" full.txt
check "/dev/full gives the errno text" grep -q "No space left on device" full.txt
check "/dev/full still saved the checkpoint" test -f ck/ckpt-00000002.bin
rm -rf ck

# Inputs that crashed: now exit 1 with a message.
mkdir -p data-dir
"$strata" train "${common[@]}" --set 'data.source="data-dir"' >dir.txt 2>&1
rc=$?
check "data.source directory exits 1 (not an abort)" test "$rc" -eq 1
check "data.source directory is named" grep -q "data-dir' is a directory" dir.txt
python3 -c 'print("{\"model\": " + "["*100000 + "]"*100000 + "}")' >deep.json
"$strata" train --config deep.json >deep.txt 2>&1
rc=$?
check "100,000-deep JSON exits 1 (not a crash)" test "$rc" -eq 1
check "100,000-deep JSON says why" grep -q "nested deeper than" deep.txt
printf '{"optimizer": {"params": {"lr": 1e400}}}' >big.json
"$strata" train --config big.json >big.txt 2>&1
rc=$?
check "lr 1e400 exits 1 (not an abort)" test "$rc" -eq 1
check "lr 1e400 is named" grep -q "1e400" big.txt

# A file as train.checkpoint_dir: refused before training, naming the key.
echo x >not-a-dir
"$strata" train "${common[@]}" --set 'train.checkpoint_dir="not-a-dir"' >ckf.txt 2>&1
rc=$?
check "checkpoint_dir file exits 1" test "$rc" -eq 1
check "checkpoint_dir file names train.checkpoint_dir" grep -q "train.checkpoint_dir" ckf.txt
check "checkpoint_dir file fails before step 1" test -z "$(grep '^step ' ckf.txt)"

# Ctrl-C under mpirun: SIGINT to mpirun (what the terminal sends its process group), with
# Open MPI's default kill timeout. Without a launcher these cases cannot run: the test is
# skipped (exit 77, ctest's SKIP_RETURN_CODE) after the cases above, never passed; under CI
# (CI=true) it fails.
if [ -z "$mpiexec" ] || ! command -v "$mpiexec" >/dev/null; then
  if [ "${CI:-}" = "true" ]; then
    echo "FAILED: Ctrl-C under mpirun: no mpirun ('${mpiexec}' not found; Open MPI: apt-get" \
         "install openmpi-bin); CI needs every case"
    exit 1
  fi
  echo "skipped: Ctrl-C under mpirun: no mpirun ('${mpiexec}' not found; Open MPI: apt-get" \
       "install openmpi-bin); the cases without it ran"
  [ "$fail" = 0 ] && exit 77
  exit $fail
fi
mpi=("$mpiexec" --oversubscribe -np 2)
[ "$(id -u)" -eq 0 ] && mpi+=(--allow-run-as-root)
mpicommon=("${common[@]}" --set gradient_accumulation_steps=2 --set steps_per_print=1
           --set scheduler.params.total_num_steps=100000 --set train.steps=100000)
"${mpi[@]}" "$strata" train "${mpicommon[@]}" >mpi.txt 2>&1 &
pid=$!
for _ in $(seq 1 900); do
  grep -q "^step *3/" mpi.txt 2>/dev/null && break
  sleep 0.1
done
kill -INT "$pid"
wait "$pid"
# Open MPI gives the ranks 2 s from its SIGCONT to SIGKILL: the step under way and the save must
# fit. On a machine so loaded that a step alone takes over 1 s, a run killed without saving is
# reported as a skip with the measured step time, not a failure (the case below covers Ctrl-C
# there, with the longer timeout rank 0 advises).
slowest=$(sed -n 's/.*| step \([0-9]*\) ms.*/\1/p' mpi.txt | sort -n | tail -1)
if ! grep -q "stopped at step" mpi.txt && [ "${slowest:-0}" -gt 1000 ]; then
  echo "skipped: Ctrl-C under mpirun with the default kill timeout: steps take up to" \
    "${slowest} ms here (a loaded machine), too slow for a step and a save within Open MPI's 2 s"
else
  check "Ctrl-C under mpirun: the ranks stopped and saved" grep -q "stopped at step" mpi.txt
  check "Ctrl-C under mpirun: latest written" test -f ck/latest
  latest=$(cat ck/latest 2>/dev/null)
  check "Ctrl-C under mpirun: both shard files" \
    test -f "ck/$latest.rank0-of-2" -a -f "ck/$latest.rank1-of-2"
  check "Ctrl-C under mpirun: swap files removed" test -z "$(ls swap)"
  step=$(sed -n 's/.*stopped at step \([0-9]*\).*/\1/p' mpi.txt | head -1)
  "${mpi[@]}" "$strata" train "${mpicommon[@]}" --set train.steps=$((step + 2)) --resume \
    >mpires.txt 2>&1
  rc=$?
  check "mpirun --resume continues after Ctrl-C" test "$rc" -eq 0
  check "mpirun --resume starts at the saved step" grep -q "at step $step" mpires.txt
fi
check "Ctrl-C under mpirun: the launch advice is logged" grep -q "odls_base_sigkill_timeout" mpi.txt

# Ctrl-C in a terminal: SIGINT to mpirun's whole process group (the second way to stop it), here
# mpirun leading a group of its own (setsid), with its own checkpoint directory. With the kill
# timeout rank 0 advises for slow steps (60 s), so that this case does not depend on how loaded
# the machine is (the case above, with the default 1 s, needs a step + save within 2 s).
mkdir -p swapg
pgcommon=("${mpicommon[@]}" --set 'train.checkpoint_dir="ckg"'
          --set 'zero_optimization.offload_optimizer.nvme_path="swapg"')
setsid "${mpi[@]}" --mca odls_base_sigkill_timeout 60 "$strata" train "${pgcommon[@]}" \
  >mpig.txt 2>&1 &
pid=$!
for _ in $(seq 1 900); do
  grep -q "^step *3/" mpig.txt 2>/dev/null && break
  sleep 0.1
done
pgid=$(ps -o pgid= -p "$pid" | tr -d ' ')
check "Ctrl-C to the process group: mpirun leads its own group" test "$pgid" = "$pid"
if [ "$pgid" = "$pid" ]; then kill -INT -- "-$pgid"; else kill -INT "$pid"; fi
wait "$pid"
check "Ctrl-C to the process group: the ranks stopped and saved" grep -q "stopped at step" mpig.txt
latest=$(cat ckg/latest 2>/dev/null)
check "Ctrl-C to the process group: both shard files" \
  test -n "$latest" -a -f "ckg/$latest.rank0-of-2" -a -f "ckg/$latest.rank1-of-2"
check "Ctrl-C to the process group: swap files removed" test -z "$(ls swapg)"
check "Ctrl-C to the process group: rank 0 said mpirun returns 2 x 60 s after a stop" \
  grep -q "mpirun returns only about 120 s later" mpig.txt

# Under mpirun, settings that make the ranks train alone are named, not a batch-size puzzle (the
# batch is resolved for the launcher's 2 processes).
"${mpi[@]}" "$strata" train "${common[@]}" --set train.steps=2 --set train_batch_size=32 \
  --set 'strata.comm.backend="single"' >single.txt 2>&1
check "mpirun with strata.comm.backend single names the backend" \
  grep -q "strata.comm.backend is single, which trains one rank, but the launcher started 2" \
  single.txt
"${mpi[@]}" "$strata" train "${common[@]}" --set train.steps=2 --set train_batch_size=32 \
  --set 'device.simulate="h200"' >sim.txt 2>&1
check "mpirun with device.simulate says it runs one rank" \
  grep -q "device.simulate runs one rank" sim.txt
exit $fail
