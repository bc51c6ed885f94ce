"""Train the embedded default model: a tiny DeepSeek-V3 that adds numbers and reverses words.

The model is transformers' own ``DeepseekV3ForCausalLM`` (MLA with q-LoRA, one dense layer, then
MoE layers with a shared expert and the ``noaux_tc`` sigmoid router), trained from scratch on the
CPU on the task of :mod:`moeserve.models.tiny_chat`, in DeepSeek's chat format. It is saved with
``save_pretrained`` next to the tiny tokenizer, which is exactly what the engine loads.

The router's ``e_score_correction_bias`` gets no gradient; as in DeepSeek-V3's auxiliary-loss-free
balancing, after every step it moves by ``--bias-update-speed`` towards under-used experts.

Batches are drawn fresh each step and never hold a held-out prompt; a curriculum (see
:class:`Curriculum`) shifts them towards additions with short operands once the common case is
learned. Greedy accuracy on held-out prompts, measured with ``model.generate``, is reported as
training goes and at the end; an answer counts only when eos follows it.

Everything is seeded (``--seed``), but CPU thread counts (``--threads``) change the order of
floating-point sums, so another thread count gives other exact weights; the accuracy does not
depend on it. Reproduce the shipped ``moeserve/assets/tiny-chat/`` (about 9-11 minutes on two
CPU cores) from the repository root with::

    python tools/train_tiny_chat.py          # PYTHONPATH=. if moeserve is not installed
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from moeserve.models.tiny import ASSISTANT, USER, write_tiny_tokenizer
from moeserve.models.tiny_chat import embedded_model_path, held_out_prompts, is_correct, make_example

IGNORE = -100  # labels the loss skips: the prompt and the padding
MAX_NEW_TOKENS = 12  # the longest answer is 8 letters then eos; room to see a model that fails to stop


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=embedded_model_path(), help="where to save the checkpoint")
    p.add_argument("--steps", type=int, default=2400)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=100, help="linear warm-up steps")
    p.add_argument("--short-operands", type=float, default=0.15,
                   help="the chance that an operand's digit count, not its value, is drawn uniformly")
    p.add_argument("--focus-after-loss", type=float, default=0.15,
                   help="switch to the focus mix once the smoothed training loss is below this")
    p.add_argument("--focus-addition-share", type=float, default=0.75, help="share of additions when focused")
    p.add_argument("--focus-short-operands", type=float, default=0.5,
                   help="--short-operands once focused")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--bias-update-speed", type=float, default=1e-3, help="router bias step per update")
    p.add_argument("--eval-every", type=int, default=400, help="steps between held-out evaluations")
    p.add_argument("--eval-prompts", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--device", default="cpu", help="train elsewhere (e.g. cuda) to try settings quickly")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model config value, e.g. --set hidden_size=160 (value parsed as JSON)")
    return p.parse_args()


def model_config(tokenizer: Any, overrides: list[str]) -> DeepseekV3Config:
    """The tiny DeepSeek-V3: 4 layers (1 dense, 3 MoE with 8 routed experts, top-2, 1 shared)."""
    settings = dict(
        vocab_size=_round_up(len(tokenizer), 16),
        hidden_size=128, intermediate_size=384, moe_intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        # Four groups of two, the best two groups eligible: V3's group-limited routing in miniature.
        n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=None,
        tie_word_embeddings=False, initializer_range=0.02,
        num_nextn_predict_layers=0,  # no multi-token-prediction layer is trained or saved
    )
    for item in overrides:
        key, value = item.split("=", 1)
        settings[key] = json.loads(value)
    return DeepseekV3Config(**settings)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def encode(tokenizer: Any, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """Token ids of one chat turn and its labels: only the answer and the closing eos are learned.

    Built from pieces because the Rust tokenizer is much faster than rendering the chat template;
    :func:`check_encoding` pins the two to the same ids.
    """
    prompt_ids = encode_prompt(tokenizer, prompt)
    answer_ids = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    return prompt_ids + answer_ids, [IGNORE] * len(prompt_ids) + answer_ids


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """bos, User, the prompt, Assistant: the chat template with ``add_generation_prompt``."""
    user, assistant = tokenizer.convert_tokens_to_ids([USER, ASSISTANT])
    body = tokenizer.encode(prompt, add_special_tokens=False)
    return [tokenizer.bos_token_id, user, *body, assistant]


def check_encoding(tokenizer: Any, rng: random.Random) -> None:
    """Fail fast if :func:`encode` ever drifts from the tokenizer's chat template."""
    for _ in range(20):
        prompt, answer = make_example(rng)
        turn = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        expected = _template_ids(tokenizer, turn, add_generation_prompt=False)
        if encode(tokenizer, prompt, answer)[0] != expected:
            raise AssertionError(f"encode() disagrees with the chat template on {prompt!r}")
        if encode_prompt(tokenizer, prompt) != _template_ids(tokenizer, turn[:1], add_generation_prompt=True):
            raise AssertionError(f"encode_prompt() disagrees with the chat template on {prompt!r}")


def _template_ids(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def make_batch(tokenizer: Any, rng: random.Random, batch_size: int, mix: Mix) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh examples, right-padded: causal attention never lets a real token see the padding after
    it, and every row starts at position 0 exactly as at inference. Returns ``input_ids, labels``
    of shape ``[B, T]``."""
    rows = [encode(tokenizer, *make_example(rng, mix.addition_share, mix.short_operands))
            for _ in range(batch_size)]
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), tokenizer.eos_token_id)
    labels = torch.full((len(rows), width), IGNORE)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
    return input_ids, labels


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(args.steps - args.warmup, 1)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class RouterBalancer:
    """DeepSeek-V3's auxiliary-loss-free load balancing for transformers' routers.

    Forward hooks count how many tokens each router sends to each expert; :meth:`update` then
    nudges ``e_score_correction_bias`` up for experts below the mean load and down for those above.
    """

    def __init__(self, model: torch.nn.Module, speed: float) -> None:
        self.speed = speed
        self.routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        self.loads = {id(r): torch.zeros_like(r.e_score_correction_bias) for r in self.routers}
        for router in self.routers:
            router.register_forward_hook(self._count)

    def _count(self, router: torch.nn.Module, _inputs: Any, outputs: tuple[torch.Tensor, ...]) -> None:
        if router.training:
            topk_indices = outputs[2]  # [T, top_k]
            self.loads[id(router)] += torch.bincount(topk_indices.flatten(), minlength=router.num_experts)

    @torch.no_grad()
    def update(self) -> float:
        """Apply one bias step and reset the counts; returns the worst max/mean load ratio seen."""
        worst = 0.0
        for router in self.routers:
            load = self.loads[id(router)]
            router.e_score_correction_bias += self.speed * torch.sign(load.mean() - load)
            worst = max(worst, (load.max() / load.mean().clamp(min=1)).item())
            load.zero_()
        return worst


@torch.no_grad()
def greedy_completions(model: DeepseekV3ForCausalLM, tokenizer: Any, prompts: list[str]) -> dict[str, tuple[str, bool]]:
    """prompt -> (greedy completion text, whether eos ended it).

    Prompts are batched by token length so no padding is needed and positions match the engine's.
    """
    by_length: dict[int, list[tuple[str, list[int]]]] = defaultdict(list)
    for prompt in prompts:
        ids = encode_prompt(tokenizer, prompt)
        by_length[len(ids)].append((prompt, ids))
    completions = {}
    for group in by_length.values():
        input_ids = torch.tensor([ids for _, ids in group], device=model.device)
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=MAX_NEW_TOKENS, pad_token_id=tokenizer.eos_token_id)
        for (prompt, _), new in zip(group, out[:, input_ids.shape[1]:].tolist()):
            completions[prompt] = (tokenizer.decode(new, skip_special_tokens=True), tokenizer.eos_token_id in new)
    return completions


def evaluate(model: DeepseekV3ForCausalLM, tokenizer: Any,
             pairs: list[tuple[str, str]]) -> tuple[dict[str, float], list[str]]:
    """Greedy accuracy over all ``pairs`` and per skill, and the failures as readable lines.

    An answer counts when it is right and followed by eos, so that generation stops by itself.
    """
    model.eval()
    completions = greedy_completions(model, tokenizer, [prompt for prompt, _ in pairs])
    model.train()
    correct: dict[str, list[bool]] = defaultdict(list)
    failures = []
    for prompt, answer in pairs:
        text, stopped = completions[prompt]
        ok = stopped and is_correct(prompt, text)
        correct["addition" if prompt.startswith("What is") else "reversal"].append(ok)
        if not ok:
            failures.append(f"{prompt!r}: expected {answer!r}, got {text!r}{'' if stopped else ' (no eos)'}")
    correct["all"] = correct["addition"] + correct["reversal"]
    return {skill: sum(ok) / len(ok) for skill, ok in correct.items()}, failures


def _report(accuracy: dict[str, float]) -> str:
    return ", ".join(f"{skill} {acc:.3f}" for skill, acc in sorted(accuracy.items()))


@dataclass(frozen=True)
class Mix:
    """What a batch holds: the share of additions, and of operands whose digit count is drawn
    first (see :func:`make_example`)."""

    addition_share: float
    short_operands: float


class Curriculum:
    """Two phases: the task mix with a few extra short operands, then a focus on addition.

    Uniform operands are 3-digit nine times in ten. Trained on those alone, the model learned
    carries but kept failing when the second operand was short (it probably found the first
    operand's digits at a fixed distance, which a shorter second operand moves); a few short
    operands from the start (``--short-operands``) prevented that, while many of them from the
    start slowed learning in our runs. Reversal is learned long before addition, so once the
    smoothed training loss says the common case is learned, batches switch to more additions
    with more short operands.
    """

    def __init__(self, first: Mix, focus: Mix, switch_loss: float) -> None:
        self.mix, self.focus, self.switch_loss = first, focus, switch_loss
        self.smoothed_loss = math.inf

    def observe(self, loss: float) -> bool:
        """Track one step's loss; True on the step that switches to the focus mix."""
        if math.isfinite(self.smoothed_loss):
            self.smoothed_loss = 0.98 * self.smoothed_loss + 0.02 * loss
        else:
            self.smoothed_loss = loss
        if self.mix != self.focus and self.smoothed_loss < self.switch_loss:
            self.mix = self.focus
            return True
        return False


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not embeddings, norms or the router bias)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "embed" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98))


def train(args: argparse.Namespace, model: DeepseekV3ForCausalLM, tokenizer: Any,
          eval_pairs: list[tuple[str, str]]) -> None:
    """``args.steps`` steps on fresh batches, reporting held-out accuracy every ``args.eval_every``."""
    rng = random.Random(args.seed)
    optimizer = make_optimizer(model, args)
    balancer = RouterBalancer(model, args.bias_update_speed)
    focus = Mix(args.focus_addition_share, args.focus_short_operands)
    curriculum = Curriculum(Mix(0.5, args.short_operands), focus, args.focus_after_loss)
    model.train()
    bar = tqdm(range(args.steps), desc="train", mininterval=2.0)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        input_ids, labels = (t.to(args.device) for t in make_batch(tokenizer, rng, args.batch_size, curriculum.mix))
        loss = train_step(model, optimizer, input_ids, labels)
        imbalance = balancer.update()
        bar.set_postfix(loss=f"{loss:.4f}", imbalance=f"{imbalance:.2f}", refresh=False)
        if curriculum.observe(loss):
            bar.write(f"step {step + 1}: smoothed loss {curriculum.smoothed_loss:.3f}, switching to {focus}")
        if (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            accuracy, _ = evaluate(model, tokenizer, eval_pairs)
            bar.write(f"step {step + 1}: loss {loss:.4f}, held-out accuracy: {_report(accuracy)}")


def train_step(model: DeepseekV3ForCausalLM, optimizer: torch.optim.Optimizer,
               input_ids: torch.Tensor, labels: torch.Tensor) -> float:
    """One AdamW step on a ``[B, T]`` batch; returns the mean loss over the labelled tokens."""
    loss = model(input_ids=input_ids, labels=labels).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.item()


def save(model: DeepseekV3ForCausalLM, out_dir: str) -> None:
    """Weights and configs by ``save_pretrained``, then the tokenizer they were trained with."""
    os.makedirs(out_dir, exist_ok=True)
    model.generation_config.pad_token_id = None  # the engine stops on eos; nothing needs padding
    model.to("cpu").save_pretrained(out_dir, safe_serialization=True)
    write_tiny_tokenizer(out_dir)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:  # the output folder is written only once trained
        tokenizer = write_tiny_tokenizer(tmp)
    check_encoding(tokenizer, random.Random(args.seed + 1))
    model = DeepseekV3ForCausalLM(model_config(tokenizer, args.set)).float()
    # The per-expert loop beats grouped_mm for these tiny experts on a CPU (about 2.5x per step).
    model.set_experts_implementation("eager")
    model.to(args.device)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    eval_pairs = held_out_prompts(args.eval_prompts, seed=args.seed)
    start = time.perf_counter()
    train(args, model, tokenizer, eval_pairs)
    minutes = (time.perf_counter() - start) / 60
    save(model, args.out)
    accuracy, failures = evaluate(model, tokenizer, eval_pairs)
    print("\n".join(["failures:", *failures]) if failures else "no failures")
    print(f"trained {args.steps} steps in {minutes:.1f} min; held-out accuracy on {len(eval_pairs)} prompts: "
          f"{_report(accuracy)}; saved to {args.out}")


if __name__ == "__main__":
    main()
