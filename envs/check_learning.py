"""Checks that `make run` learned: reads report/summary.json (written by `rollarc run`) and
exits non-zero unless FrozenLake ends at >= 0.9 success and every other task ends at least
1.5x its random-policy rate (measured on the environment itself, see README)."""
import json
import sys

path = sys.argv[1] if len(sys.argv) > 1 else "report/summary.json"
with open(path) as f:
    summary = json.load(f)
ok = summary.get("state") == "succeeded"
print(f"job {summary.get('job')}: {summary.get('state')} after {summary.get('steps')} steps in {summary.get('wall_s', 0):.0f} s")
for name, t in sorted(summary["tasks"].items()):
    end, start, rnd = t["success_end"], t["success_start"], t.get("success_random")
    if name == "frozenlake":
        good = end >= 0.9
        want = ">= 0.90"
    else:
        base = max(rnd if rnd is not None else start, 0.01)
        good = end >= 1.5 * base
        want = f">= 1.5 x {base:.3f}"
    ok &= good
    print(f"  {name:<12} random {rnd if rnd is not None else float('nan'):.3f}  start {start:.3f}  end {end:.3f}  (want {want}) {'ok' if good else 'NOT LEARNED'}")
sys.exit(0 if ok else 1)
