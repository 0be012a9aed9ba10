"""Rollout importance sampling (--rollout-is): the weights by hand, the defaults by dtype, the
metrics of tiny runs; and a PPO micro-step reads nothing back to the host."""

from __future__ import annotations

import contextlib
import math
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rlhf.algorithms.ppo_math import policy_loss, rollout_is_correction, rollout_is_ratio
from rlhf.cli import main
from rlhf.config import PPOConfig
from rlhf.errors import UserError
from rlhf.models.tiny import build_char_tokenizer
from rlhf.stages.ppo import update_phase
from rlhf.stages.ppo.generation_phase import decode_responses
from tests.conftest import read_metrics, run_cli
from tests.test_rollout_logprobs import prompts  # noqa: F401, F811 (the same prompts and vowel reward)

# ---------------------------------------------------------------- the weights, by hand

LOG_W = [[math.log(3.0), math.log(0.25), 0.0], [math.log(1.5), 0.0, 0.0]]  # old - rollout
MASK = torch.tensor([[True, True, True], [True, True, False]])


def _ratio() -> torch.Tensor:
    rollout = torch.full((2, 3), -1.0)
    return rollout_is_ratio(rollout + torch.tensor(LOG_W), rollout, MASK)


def test_ratio_is_exp_of_the_log_prob_difference_and_1_off_the_mask() -> None:
    torch.testing.assert_close(_ratio(), torch.tensor([[3.0, 0.25, 1.0], [1.5, 1.0, 1.0]]))
    far = rollout_is_ratio(torch.tensor([[0.0]]), torch.tensor([[-100.0]]), torch.tensor([[True]]))
    assert far.item() == pytest.approx(math.exp(20.0))  # clamped, finite: still far out of bounds


def test_truncate_caps_each_weight_and_keeps_every_token() -> None:
    weights, mask, capped = rollout_is_correction(_ratio(), MASK, "truncate", 2.0)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.25, 1.0], [1.5, 1.0, 0.0]]))
    assert torch.equal(mask, MASK)
    assert capped.tolist() == [[True, False, False], [False, False, False]]


def test_mask_drops_tokens_outside_one_over_cap_to_cap() -> None:
    weights, mask, dropped = rollout_is_correction(_ratio(), MASK, "mask", 2.0)
    assert mask.tolist() == [[False, False, True], [True, True, False]]  # 3 > 2 and 0.25 < 1/2 leave
    assert torch.equal(dropped, MASK & ~mask)
    torch.testing.assert_close(weights, torch.tensor([[0.0, 0.0, 1.0], [1.5, 1.0, 0.0]]))


def test_off_changes_nothing() -> None:
    weights, mask, capped = rollout_is_correction(_ratio(), MASK, "off", 2.0)
    assert weights is None and torch.equal(mask, MASK) and not capped.any()


def test_weighted_policy_loss_by_hand() -> None:
    """At ratio 1 (logp == old) the clipped surrogate is -A per token: TIS weighs it by min(w, cap),
    a token mean over the mask; MIS averages the kept tokens only (the normaliser drops the rest)."""
    logp = torch.full((2, 3), -1.0)
    advantages = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    weights, mask, _ = rollout_is_correction(_ratio(), MASK, "truncate", 2.0)
    loss, _, _ = policy_loss(logp, logp, advantages, mask, 0.2, token_weights=weights)
    assert loss.item() == pytest.approx(-(1 * 2.0 + 2 * 0.25 + 3 * 1.0 + 4 * 1.5 + 5 * 1.0) / 5)
    weights, mask, _ = rollout_is_correction(_ratio(), MASK, "mask", 2.0)
    loss, _, _ = policy_loss(logp, logp, advantages, mask, 0.2, token_weights=weights)
    assert loss.item() == pytest.approx(-(3 * 1.0 + 4 * 1.5 + 5 * 1.0) / 3)
    plain, _, _ = policy_loss(logp, logp, advantages, MASK, 0.2)
    assert plain.item() == pytest.approx(-15 / 5)


def test_the_weight_carries_no_gradient() -> None:
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    ratio = rollout_is_ratio(logp, torch.full((2, 3), -1.5), MASK)
    weights, mask, _ = rollout_is_correction(ratio, MASK, "truncate", 2.0)
    loss, _, _ = policy_loss(logp, logp.detach(), torch.ones(2, 3), mask, 0.2, token_weights=weights)
    loss.backward()
    w = math.exp(0.5)  # each token's gradient is -A x ratio' x w / n, ratio' = 1 at logp == old
    torch.testing.assert_close(logp.grad, -w / 5 * MASK.float())


# ---------------------------------------------------------------- the defaults by dtype


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_16_bit_recomputes_and_truncates_by_default(dtype: str) -> None:
    config = PPOConfig()
    assert config.recomputes_old_logprobs(dtype) and config.rollout_is_mode(dtype) == "truncate"
    assert PPOConfig(rollout_is="off").rollout_is_mode(dtype) == "off"
    assert PPOConfig(rollout_is="mask").rollout_is_mode(dtype) == "mask"
    # Told to take generation's log-probs, the weight would be 1: auto is off.
    told = PPOConfig(recompute_old_logprobs=False)
    assert not told.recomputes_old_logprobs(dtype) and told.rollout_is_mode(dtype) == "off"


def test_fp32_keeps_generations_logprobs_and_no_correction_by_default() -> None:
    config = PPOConfig()
    assert not config.recomputes_old_logprobs("fp32") and config.rollout_is_mode("fp32") == "off"
    assert PPOConfig(recompute_old_logprobs=True).rollout_is_mode("fp32") == "off"
    for mode in ("truncate", "mask"):  # an explicit correction recomputes (else w == 1 identically)
        explicit = PPOConfig(rollout_is=mode)
        assert explicit.recomputes_old_logprobs("fp32") and explicit.rollout_is_mode("fp32") == mode


def test_a_correction_without_recomputed_logprobs_is_one_clear_error() -> None:
    config = PPOConfig(actor="a", reward_fn=["sort"], rollout_is="truncate", recompute_old_logprobs=False)
    with pytest.raises(UserError, match="rollout_is: truncate .* recompute_old_logprobs: false"):
        config.validate()


@pytest.mark.parametrize("flags,message", [
    (["--rollout-is", "clip"], "'clip' is not one of 'auto', 'truncate', 'mask', 'off'"),
    (["--rollout-is-cap", "1"], "--rollout-is-cap: 1.0 must be > 1"),
    (["--rollout-is", "mask", "--no-recompute-old-logprobs"], "rollout_is: mask weighs"),
])
def test_bad_values_are_one_line(flags: list[str], message: str, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["ppo", "--actor", str(tmp_path), "--reward-fn", "sort", "--data", str(tmp_path / "p.jsonl"),
              "--output", str(tmp_path / "out"), *flags])
    assert stop.value.code != 0
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


# ---------------------------------------------------------------- no host read in a micro-step

HOST_READS = ("__float__", "item", "tolist", "__bool__", "__int__")
KNOWN_READS = {("transformers.masking_utils", "_ignore_causal_mask_sdpa")}
"""Host reads inside a micro-step that are not this project's: transformers' SDPA mask reads the
padding mask (`padding_mask.all()`) to choose is_causal, in every forward it builds a mask for."""


@contextlib.contextmanager
def no_host_reads(seen: set[tuple[str, str]]) -> Iterator[None]:
    """Tensor.__float__/item/tolist/__bool__/__int__ raise while the block runs (each is a host
    sync on a GPU), except where KNOWN_READS calls them (counted into `seen`)."""
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def refused(name: str):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1)
            where = (caller.f_globals.get("__name__", ""), caller.f_code.co_name)
            if where not in KNOWN_READS:
                raise AssertionError(f"host read in a micro-step: Tensor.{name} in {where[0]}.{where[1]} "
                                     f"line {caller.f_lineno}")
            seen.add(where)
            return saved[name](self, *args, **kwargs)
        return read

    for name in HOST_READS:
        setattr(torch.Tensor, name, refused(name))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


@pytest.fixture
def guarded_micro_steps(monkeypatch) -> list[int]:
    """Every PPO micro-step of the test runs under `no_host_reads`; the list counts them."""
    real = update_phase.UpdatePhase.micro_step
    steps: list[int] = []
    seen: set[tuple[str, str]] = set()

    def micro_step(self, *args, **kwargs):
        with no_host_reads(seen):
            metrics = real(self, *args, **kwargs)
        assert all(torch.is_tensor(v) for v in metrics.values()), metrics
        steps.append(1)
        return metrics

    monkeypatch.setattr(update_phase.UpdatePhase, "micro_step", micro_step)
    return steps




def _ppo(model: Path, prompts: Path, out: Path, *extra: str, critic: bool = True) -> list[dict]:
    reward = f"{prompts.parent / 'vowels.py'}:vowels"
    main(["ppo", "--actor", str(model), *(["--critic", str(model)] if critic else []), "--reward-fn", reward,
          "--data", str(prompts), "--output", str(out), "--max-steps", "2", "--generation-batch-size", "8",
          "--max-new-tokens", "6", "--micro-batch-size", "4", "--report-to", "none", "--optimizer-impl", "torch",
          "--kl-coef", "0.1", "--lr", "1e-3", *extra])
    return read_metrics(out)


def test_bf16_run_recomputes_and_truncates(tiny_model_dirs, prompts, tmp_path, guarded_micro_steps) -> None:
    """bf16 on the CPU, defaults: the training forward's old log-probs, generation's weighed against
    them (truncated at 2), logged per iteration; no micro-step reads a tensor back."""
    rows = _ppo(tiny_model_dirs["llama"], prompts, tmp_path / "ppo", "--dtype", "bf16")
    assert len(guarded_micro_steps) == 4
    for row in rows:
        assert row["old_logprobs_recomputed"] == 1.0
        assert row["rollout_is_ratio_mean"] == pytest.approx(1.0, abs=0.05)
        assert row["rollout_is_ratio_max"] >= row["rollout_is_ratio_mean"] * (1 - 1e-6)
        assert 0.0 <= row["rollout_is_truncated_fraction"] <= 1.0
        assert "rollout_is_masked_fraction" not in row


def test_fp32_explicit_truncate_recomputes_with_a_ratio_of_about_1(tiny_model_dirs, prompts, tmp_path,
                                                                   guarded_micro_steps) -> None:
    rows = _ppo(tiny_model_dirs["llama"], prompts, tmp_path / "ppo", "--dtype", "fp32", "--rollout-is", "truncate")
    plain = _ppo(tiny_model_dirs["llama"], prompts, tmp_path / "plain", "--dtype", "fp32")
    for row, default in zip(rows, plain):
        assert row["old_logprobs_recomputed"] == 1.0 and default["old_logprobs_recomputed"] == 0.0
        assert row["rollout_is_ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        assert 1.0 <= row["rollout_is_ratio_max"] < 1.001
        assert row["rollout_is_truncated_fraction"] == 0.0
        assert not any(k.startswith("rollout_is") for k in default)
        assert row["policy_loss"] == pytest.approx(default["policy_loss"], abs=1e-4)


def test_on_policy_grpo_masks_against_the_trained_forward(tiny_model_dirs, prompts, tmp_path,
                                                          guarded_micro_steps) -> None:
    """GRPO's on-policy update runs no old log-prob forward: the weight compares the trained forward's
    own (detached) log-probs with generation's; mask logs the share it dropped."""
    rows = _ppo(tiny_model_dirs["llama"], prompts, tmp_path / "ppo", "--dtype", "bf16", "--rollout-is", "mask",
                "--advantage-estimator", "grpo", "--samples-per-prompt", "2", critic=False)
    assert guarded_micro_steps
    for row in rows:
        assert "old_logprobs_recomputed" not in row  # no separate forward
        assert row["rollout_is_ratio_mean"] == pytest.approx(1.0, abs=0.05)
        assert 0.0 <= row["rollout_is_masked_fraction"] <= 1.0
        assert "rollout_is_truncated_fraction" not in row


@pytest.mark.gpu
def test_micro_step_makes_no_cuda_sync(tiny_model_dirs, prompts, tmp_path, monkeypatch) -> None:
    """On CUDA, every synchronizing call inside a micro-step warns (sync debug mode); none may come
    from this project's code. ("error" would stop at KNOWN_READS' transformers mask check, which
    is not ours; the warning names the Python frame that made the call.)"""
    real = update_phase.UpdatePhase.micro_step
    syncs: list[str] = []

    def micro_step(self, *args, **kwargs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                metrics = real(self, *args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs.extend(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)
                     and "transformers/masking_utils.py" not in w.filename)
        return metrics

    monkeypatch.setattr(update_phase.UpdatePhase, "micro_step", micro_step)
    _ppo(tiny_model_dirs["llama"], prompts, tmp_path / "ppo", "--dtype", "bf16")
    assert not syncs, syncs


# ---------------------------------------------------------------- decoding the responses


def test_decoded_responses_are_each_rows_masked_tokens() -> None:
    """decode_responses moves the response columns to the host once and decodes what the per-row
    boolean index of the device rows decoded."""
    tok = build_char_tokenizer()
    prompt_length = 4
    rows = [tok.encode(text, add_special_tokens=False) for text in ("ab", " cde ", "", "fghij")]
    sequences = torch.full((len(rows), prompt_length + 6), tok.pad_token_id)
    action = torch.zeros_like(sequences, dtype=torch.bool)
    for i, ids in enumerate(rows):
        sequences[i, prompt_length - 2 : prompt_length] = torch.tensor(tok.encode("xy", add_special_tokens=False))
        sequences[i, prompt_length : prompt_length + len(ids)] = torch.tensor(ids, dtype=torch.long)
        action[i, prompt_length : prompt_length + len(ids)] = True
    expected = [t.strip() for t in tok.batch_decode([s[a] for s, a in zip(sequences, action)],
                                                    skip_special_tokens=True)]
    assert decode_responses(tok, sequences, action, prompt_length) == expected == ["ab", "cde", "", "fghij"]


# ---------------------------------------------------------------- over ranks


class _Rank:
    """A DistributedContext stand-in for rank `rank` of 2 whose all-reduce adds the other rank's input."""

    world_size, device = 2, torch.device("cpu")

    def __init__(self, rank: int, other: list[torch.Tensor]) -> None:
        self.rank, self.other, self.sent = rank, other, []

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        self.sent.append(value)
        return value + self.other[0] if self.other else value


def test_update_metrics_sum_and_max_over_ranks_in_one_all_reduce() -> None:
    ranks = []
    for ratio_max, loss, grad in ((1.5, 1.0, 0.5), (3.0, 2.0, 1.5)):
        metrics = update_phase.UpdateMetrics()
        for _ in range(2):  # two micro-steps
            metrics.add({"policy_loss": torch.tensor(loss), "rollout_is_ratio_max": torch.tensor(ratio_max / 2)})
        metrics.add({"rollout_is_ratio_max": torch.tensor(ratio_max), "actor_grad_norm": grad})
        ranks.append(metrics)
    second = _Rank(1, [])
    ranks[1].all_reduced(second)
    first = _Rank(0, second.sent)
    sums, maxima = ranks[0].all_reduced(first)
    assert len(first.sent) == 1  # one collective for sums and maxima
    assert sums == {"policy_loss": 6.0, "actor_grad_norm": 2.0}
    assert maxima == {"rollout_is_ratio_max": 3.0}


@pytest.mark.slow  # a real 2-rank gloo run; the fake two-rank reduction above runs by default
@pytest.mark.usefixtures("cpu_only")
def test_two_ranks_log_the_rollout_weights_over_both(tiny_model_dirs, prompts, tmp_path) -> None:
    out = tmp_path / "two"
    reward = f"{prompts.parent / 'vowels.py'}:vowels"
    done = run_cli(["ppo", "--actor", str(tiny_model_dirs["llama"]), "--reward-fn", reward, "--data", str(prompts),
                    "--output", str(out), "--max-steps", "2", "--generation-batch-size", "4", "--max-new-tokens", "6",
                    "--micro-batch-size", "2", "--report-to", "none", "--optimizer-impl", "torch", "--dtype", "bf16",
                    "--advantage-estimator", "grpo", "--samples-per-prompt", "2", "--rollout-is-cap", "1.0002"],
                   nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]
    for row in read_metrics(out):
        assert row["rollout_is_ratio_mean"] == pytest.approx(1.0, abs=0.05)
        assert row["rollout_is_ratio_max"] >= 1.0
        assert 0.0 <= row["rollout_is_truncated_fraction"] <= 1.0
