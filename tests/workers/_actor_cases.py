"""Shared inputs of the actor tests (imported by the tests and by the torchrun script)."""

import torch

from megatron_dapo.workers.batch import PolicyBatch

VOCAB, PAD = 16, 0


def overrides(**extra) -> list[str]:
    base = {"actor.ppo_mini_batch_size": 2, "rollout.n": 4, "data.train_batch_size": 4, "data.gen_batch_size": 4,
            "actor.lr": 1e-3, "actor.clip_grad": 0.0, "actor.weight_decay": 0.0, "actor.lr_warmup_steps": 0,
            "trainer.balance_batch": False}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def random_batch(seed: int = 0, B: int = 16, P: int = 6, T: int = 8) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(1, VOCAB, (B, P), generator=g)
    prompt_length = torch.randint(2, P + 1, (B,), generator=g)
    responses = torch.randint(1, VOCAB, (B, T), generator=g)
    response_length = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < response_length[:, None]).float()
    scores = torch.randn(B, generator=g)
    return dict(prompt_ids=prompt_ids, prompt_length=prompt_length, responses=responses,
                response_length=response_length, response_mask=mask, scores=scores)


def policy_batch(actor, raw: dict, *, perturb_old: float = 0.0) -> PolicyBatch:
    lp = actor.compute_log_prob(raw["prompt_ids"], raw["prompt_length"], raw["responses"], raw["response_length"])
    old = lp.log_probs + perturb_old * torch.linspace(-1, 1, lp.log_probs.numel()).view_as(lp.log_probs)
    adv = raw["scores"][:, None] * raw["response_mask"]
    return PolicyBatch(prompt_ids=raw["prompt_ids"], prompt_length=raw["prompt_length"], responses=raw["responses"],
                       response_length=raw["response_length"], response_mask=raw["response_mask"],
                       old_log_probs=old * raw["response_mask"], advantages=adv,
                       rollout_log_probs=lp.log_probs, index=[str(i // 4) for i in range(len(raw["scores"]))])


def flat_params(actor) -> torch.Tensor:
    from megatron_dapo.models.forward import unwrap_model

    return torch.cat([p.detach().float().reshape(-1).cpu()
                      for c in actor.policy.chunks for _, p in sorted(unwrap_model(c).named_parameters())])


def capture_grads(actor) -> list:
    """Snapshot the reduced gradients (DDP main_grad) at every optimizer step: Adam's first steps are
    nearly sign(grad) * lr, so comparing weights after a step cannot see the gradient's scale."""
    from megatron_dapo.models.forward import unwrap_model

    snaps = []
    step = actor.optimizer.step

    def spy():
        snaps.append(torch.cat([p.main_grad.detach().float().reshape(-1).cpu().clone()
                                for c in actor.policy.chunks for _, p in sorted(unwrap_model(c).named_parameters())]))
        return step()

    actor.optimizer.step = spy
    return snaps
