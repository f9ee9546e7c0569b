import asyncio, json, sys, shutil
from pathlib import Path
from tempering.demo.run import run_demo_async

seed = int(sys.argv[1]); staleness = None if sys.argv[2] == "seq" else int(sys.argv[2])
opts = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
p = Path(f"/tmp/probe-{sys.argv[2]}-{seed}-{abs(hash(sys.argv[3] if len(sys.argv)>3 else ''))%1000}"); shutil.rmtree(p, ignore_errors=True)
r = asyncio.run(run_demo_async(path=p, seed=seed, max_staleness=staleness, train_options=opts, name=f"x{seed}", echo=lambda _: None))
rows = [json.loads(l) for l in open(r.history_path)]
for row in rows:
    if "train/reward" in row:
        print(row["step"], {k: round(v, 4) for k, v in row.items() if k.startswith(("offpolicy", "train/reward", "policy"))})
print("VAL", sys.argv[2:], seed, {k: round(v, 3) for k, v in r.val_rewards.items()}, round(r.training_seconds, 1))
