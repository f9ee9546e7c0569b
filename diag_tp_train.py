"""Diagnostic (not committed): the TP train scenario on 2 GPUs; stacks after 100 s."""
import os, signal, subprocess, sys, tempfile, time
from pathlib import Path
sys.path[:0] = ["tests", "tests/parallel"]
from rank_processes import free_port
from tp_model import full_adapter, tiny_llama, wrap_with_adapter
out = Path(tempfile.mkdtemp())
wrap_with_adapter(tiny_llama(), full_adapter()).save_pretrained(str(out / "start"))
port = free_port()
procs = []
for rank in range(2):
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs.append(subprocess.Popen([sys.executable, "tests/parallel/tp_rank.py", "train", str(out), "cuda"], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
start = time.time()
while time.time() - start < float(sys.argv[1]) and any(p.poll() is None for p in procs):
    time.sleep(1)
print("elapsed", round(time.time() - start), "returncodes", [p.poll() for p in procs], flush=True)
for p in procs:
    if p.poll() is None:
        p.send_signal(signal.SIGUSR1)
time.sleep(3)
for rank, p in enumerate(procs):
    p.kill()
    text = p.communicate()[0]
    lines = [l for l in text.splitlines() if "eartbeat" not in l and "ProcessGroupNCCL" not in l and l.strip()]
    print(f"---- rank {rank} ----")
    print("\n".join(lines)[-5000:])
print(sorted(os.listdir(out)))
