"""CPU seconds per process of a served run at one stream (default vs plain), /proc sampled."""
import os, sys, subprocess, time, json, tempfile
from pathlib import Path
sys.path.insert(0, "/work/main/benchmarks")
from serving_ceiling import start_server, stop_server
from serving_overhead import model_repository
from dspark.config import EngineConfig
from side_by_side import parse_engine

TICK = os.sysconf("SC_CLK_TCK")
def procs():
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit(): continue
        try:
            stat = open(f"/proc/{pid}/stat").read()
            cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:120]
        except OSError: continue
        f = stat.rsplit(")", 1)[1].split()
        out[int(pid)] = (cmd, (int(f[11]) + int(f[12])) / TICK)
    return out

def run(name, spec, port):
    cfg = parse_engine(spec, 1) if False else None
    root = Path(tempfile.mkdtemp())
    fields = dict(kv.split("=") for kv in spec.split(",") if kv)
    config = EngineConfig(**fields)
    repo = model_repository(root, config, 1)
    proc = start_server(repo, port, port + 1, port + 2, root / "log")
    try:
        bench = [sys.executable, "-m", "dspark_client.cli", "bench", "--url", f"localhost:{port+1}", "--concurrency", "1", "--num-prompts", "8", "--max-tokens", "96"]
        # warm
        subprocess.run(bench[:-4] + ["--num-prompts", "2", "--max-tokens", "32"], capture_output=True)
        before = procs(); t0 = time.time()
        r = subprocess.run(bench, capture_output=True, text=True)
        wall = time.time() - t0; after = procs()
        print(name, "wall", round(wall, 1)); print(r.stdout[-600:])
        rows = []
        for pid, (cmd, t) in after.items():
            d = t - before.get(pid, (cmd, 0.0))[1]
            if d > 0.05: rows.append((d, pid, cmd))
        for d, pid, cmd in sorted(rows, reverse=True)[:8]: print(f"  {d:6.2f} s cpu  {d/wall*100:5.1f}%  {cmd}")
    finally:
        stop_server(proc, (port, port + 1, port + 2))

run("plain", "spec_mode=off", 18100)
run("default", "", 18200)
