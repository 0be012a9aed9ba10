"""TRL's documented example reward functions, unchanged, for running in both trainers.

The bodies are those of TRL's GRPOTrainer docs ("Using a custom reward function", Examples 1-6
and the quick start) and of its trainer_state test; the docs reuse the name `reward_func`, so
they are named here by what they do, and the helpers Example 4 leaves to the reader are defined.
`curriculum_reward` (trainer_state + log_metric) and `probe` (records how the trainer called it)
are ours. scripts/check_trl_reward_functions.py runs this file in TRL's GRPOTrainer and in
`rlhf ppo`; tests/test_trl_reward_functions.py in `rlhf ppo`:

    rlhf ppo --advantage-estimator grpo --reward-fn scripts/trl_reward_examples.py:reward_len ...

Standard rows (prompt strings): every function but format_reward_func. Conversational rows
(prompt messages): format_reward_func, reward_num_tokens, math_reward_func, coding_reward_func,
async_reward_func, curriculum_reward, probe.
"""

import asyncio
import json
import os
import re


def reward_num_tokens(completion_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completion_ids]


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def _text(completion):
    return completion[0]["content"] if isinstance(completion, list) else completion


def check_math_solution(prompt, completion):
    return any(ch.isdigit() for ch in _text(completion))


def test_code_solution(prompt, completion):
    return "(" in _text(completion)


def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "math":
            # Calculate math-specific reward
            correct = check_math_solution(prompt, completion)
            reward = 1.0 if correct else -1.0
            rewards.append(reward)
        else:
            # Return None for non-math tasks
            rewards.append(None)
    return rewards


def coding_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "coding":
            # Calculate coding-specific reward
            works = test_code_solution(prompt, completion)
            reward = 1.0 if works else -1.0
            rewards.append(reward)
        else:
            # Return None for non-coding tasks
            rewards.append(None)
    return rewards


async def async_reward_func(prompts, completions, **kwargs):
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion else 0.0 for completion in completions]


def accuracy_with_logging(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
    extracted = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
    extracted = [m.group(1) if m else None for m in extracted]
    rewards = [1.0 if e == gt else 0.0 for e, gt in zip(extracted, ground_truth)]

    if log_extra:
        log_extra("golden_answer", list(ground_truth))
        log_extra("extracted_answer", [e or "[none]" for e in extracted])

    if log_metric:
        log_metric("accuracy", sum(rewards) / len(rewards))

    return rewards


def reward_with_trainer_state(completions, **kwargs):
    trainer_state = kwargs.get("trainer_state")
    assert trainer_state is not None
    # transformers.TrainerState instance should have a `global_step` property.
    assert hasattr(trainer_state, "global_step")
    return [float(len(set(completion))) for completion in completions]


def curriculum_reward(completions, trainer_state, log_metric, **kwargs):
    """A target length that grows with training progress; logs the progress it saw."""
    progress = trainer_state.global_step / max(trainer_state.max_steps, 1)
    log_metric("progress", progress)
    log_metric("global_step", trainer_state.global_step)
    target = 4 + 12 * progress
    return [-abs(target - len(_text(c))) for c in completions]


def probe(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, **kwargs):
    """Scores 0; with TRL_REWARD_PROBE set, appends one JSON line per call saying what it got."""
    path = os.environ.get("TRL_REWARD_PROBE")
    if path:
        record = {
            "columns": sorted(kwargs),
            "rows": len(completions),
            "prompt": type(prompts[0]).__name__,
            "prompt_roles": [m["role"] for m in prompts[0]] if isinstance(prompts[0], list) else None,
            "completion": type(completions[0]).__name__,
            "completion_message": sorted(completions[0][0]) if isinstance(completions[0], list) else None,
            "completion_ids": all(isinstance(ids, list) and all(isinstance(i, int) for i in ids)
                                  for ids in completion_ids) and len(completion_ids) == len(completions),
            "global_step": trainer_state.global_step,
            "max_steps": trainer_state.max_steps,
            "epoch": trainer_state.epoch,
            "logs_callable": callable(log_extra) and callable(log_metric),
            "column_lists": all(isinstance(v, list) and len(v) == len(completions) for v in kwargs.values()),
        }
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    return [0.0] * len(completions)


STANDARD = ["reward_num_tokens", "reward_len", "math_reward_func", "coding_reward_func", "async_reward_func",
            "accuracy_with_logging", "reward_with_trainer_state", "curriculum_reward", "probe"]
"""The functions for standard rows (prompt strings)."""
CONVERSATIONAL = ["format_reward_func", "reward_num_tokens", "math_reward_func", "coding_reward_func",
                  "async_reward_func", "curriculum_reward", "probe"]
"""The functions for conversational rows (prompt messages)."""
