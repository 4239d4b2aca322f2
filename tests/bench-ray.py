"""The scheduler benchmark's loop on Ray async actors, for `rollarc bench --what scheduler`.

Concurrent episodes, each a reset then `turns` turns of generate (eight zero-latency
generation actors, 8 tokens an answer) and env.step (eight zero-latency environment actors,
each holding its share of the episodes, 8 tokens an observation), every episode an asyncio
task of the driver awaiting its actor calls. No trainer, no buffer: a lower bound for the same
loop written on Ray. Prints one JSON line.

Usage: bench-ray.py EPISODES TURNS
"""

import asyncio
import json
import sys
import time

import ray

ACTORS = 8


@ray.remote
class Shard:
    async def generate(self, context):
        return [7] * 8


@ray.remote
class Envs:
    def __init__(self, turns):
        self.turns = turns
        self.turn = {}

    async def reset(self, episode):
        self.turn[episode] = 0
        return [1] * 8

    async def step(self, episode, action):
        self.turn[episode] += 1
        done = self.turn[episode] >= self.turns
        if done:
            del self.turn[episode]
        return [1] * 8, 0.0, done


async def episode(i, shard, envs):
    context = list(await envs.reset.remote(i))
    while True:
        answer = await shard.generate.remote(context)
        context += answer
        observation, _reward, done = await envs.step.remote(i, answer)
        context += observation
        if done:
            return len(context)


async def run(n, shards, envs):
    await asyncio.gather(*(episode(i, shards[i % ACTORS], envs[i % ACTORS]) for i in range(n)))


def main():
    n, turns = int(sys.argv[1]), int(sys.argv[2])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    shards = [Shard.remote() for _ in range(ACTORS)]
    envs = [Envs.remote(turns) for _ in range(ACTORS)]
    # Actors started and warm before the clock starts.
    asyncio.run(run(ACTORS * 4, shards, envs))
    t = time.perf_counter()
    asyncio.run(run(n, shards, envs))
    wall = time.perf_counter() - t
    steps = n * turns
    print(json.dumps({
        "ray": ray.__version__,
        "episodes": n,
        "turns": turns,
        "steps": steps,
        "wall_s": wall,
        "us_per_step": wall * 1e6 / steps,
    }))
    ray.shutdown()


if __name__ == "__main__":
    main()
