"""A PyTorch trainer fed by rollarc (not run in CI: PyTorch wheels are too large there).

    python examples/torch_loop.py --service http://127.0.0.1:8080 --job job-1 \
        --model my-model-dir --out /shared/weights

Each step: lease the job's batch, compute a clipped policy-gradient loss on the generated
tokens (the behaviour log-probabilities from rollout, the advantage the job computed per
group), take one optimiser step, write the weights as safetensors to a path the service can
read, announce them, acknowledge the batch. Any exception gives the batch back.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from rollarc import Client, sequences


def loss_of(model: torch.nn.Module, batch, eps: float = 0.2, device: str = "cuda") -> torch.Tensor:
    """Token-mean PPO-clip loss over the batch's generated tokens (old = behaviour)."""
    total, count = torch.zeros((), device=device), 0
    for s in batch.samples():
        if s["status"] != "completed" or sum(s["loss_mask"]) == 0:
            continue
        # One sequence per context the policy saw (more than one when turns were dropped).
        for tokens, loss_mask, behaviour in sequences(s):
            ids = torch.tensor(tokens, device=device).unsqueeze(0)
            logits = model(ids).logits[0, :-1].float()
            targets = ids[0, 1:]
            logp = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
            mask = torch.tensor(loss_mask[1:], device=device, dtype=torch.bool)
            old = torch.tensor(behaviour[1:], device=device)
            ratio = torch.exp(logp - old)
            adv = torch.full_like(ratio, s["advantage"])
            obj = torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
            total = total - obj[mask].sum()
            count += int(mask.sum())
    return total / max(count, 1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--service", default="http://127.0.0.1:8080")
    p.add_argument("--job", required=True)
    p.add_argument("--model", required=True, help="the job's base checkpoint (Hugging Face directory)")
    p.add_argument("--out", required=True, help="a directory the service can read")
    p.add_argument("--lr", type=float, default=1e-6)
    a = p.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.bfloat16).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    c = Client(a.service)

    for batch in c.batches(a.job, binary=True):
        with batch:  # acknowledged at the end of the block, given back on an exception
            opt.zero_grad()
            loss = loss_of(model, batch, device=device)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            version = batch.step  # step k (from 1) produces version k
            path = out / f"v{version}.safetensors"
            # Names as the job's model has them; rollarc checks every name and shape.
            save_file({k: v.float().cpu().contiguous() for k, v in model.state_dict().items()}, path)
            c.announce_weights(a.job, version, path)
            batch.stats["loss"] = float(loss)
            print(f"step {batch.step}: loss {float(loss):.4f}, {len(batch)} samples → v{version}")


if __name__ == "__main__":
    main()
