#!/usr/bin/env python3
"""Fails when a process started during a test run is left behind as an orphan.

Usage: check-orphans.py MARKER
MARKER holds the run's start time (seconds since the epoch, as `date +%s` writes it). A live
(not zombie) process whose parent is 1 (orphans are re-parented to init) and that started at
or after that time is one the run started and did not end: its pid, age and command line are
printed, and the exit status is 1. A process may take a moment to die after its parent: the
check waits up to 5 s for the list to empty before it fails.
"""
import os
import sys
import time


def boot_time():
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return int(line.split()[1])
    raise SystemExit("check-orphans: no btime in /proc/stat")


def orphans(since):
    tick = os.sysconf("SC_CLK_TCK")
    boot = boot_time()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        state, ppid, start_ticks = fields[0], int(fields[1]), int(fields[19])
        started = boot + start_ticks / tick
        if state != "Z" and ppid == 1 and started >= since and int(name) != os.getpid():
            found.append((int(name), time.time() - started, cmd or stat[: stat.rfind(")") + 1]))
    return found


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    with open(sys.argv[1]) as f:
        since = int(f.read().strip())
    deadline = time.time() + 5
    left = orphans(since)
    while left and time.time() < deadline:
        time.sleep(0.2)
        left = orphans(since)
    if left:
        print(f"check-orphans: {len(left)} process(es) started by this run are still running:")
        for pid, age, cmd in left:
            print(f"  pid {pid}, {age:.0f} s old: {cmd[:200]}")
        sys.exit(1)
    print("check-orphans: no process of this run is left behind")


if __name__ == "__main__":
    main()
