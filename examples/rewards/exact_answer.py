"""A custom reward in one function, for `kind = "python"` (see docs/reward-functions.md).

rollarc calls compute_score once per finished trajectory, in the sandbox:
  row         the dataset row (or the environment's reference, e.g. {"answer": "11"})
  answer      the policy's final answer text
  transcript  an agent episode's messages and tool calls (None for other tasks)
Return a number, or a dict with a numeric "score" whose other keys become the score's details
(shown with the trajectory). Raising, returning something else, or running past the
function's `item_timeout_s` refuses the call (the job's fault budget counts it).
"""
import re


def compute_score(row, answer, transcript):
    expected = str((row or {}).get("answer", "")).strip()
    numbers = re.findall(r"-?\d+(?:\.\d+)?", answer or "")
    parsed = numbers[-1] if numbers else None
    return {"score": 1.0 if parsed == expected else 0.0, "parsed": parsed, "expected": expected}
