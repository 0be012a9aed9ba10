"""A TRL-style reward function for the tool-rollout tests: the final answer equals the row's `answer`."""


def exact_answer(prompts, completions, answer, **kwargs):
    finals = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(f.strip() == a) for f, a in zip(finals, answer)]
