"""Settings counted in optimizer steps, checked against the run's own length once the Trainer knows it (the data,
packing, batch size and accumulation decide it): a warmup or evaluation interval written for a longer run."""

import logging

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

log = logging.getLogger(__name__)


class RunLengthCheck(TrainerCallback):
    """Warn, before the first step, of step counts the run never reaches."""

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: object) -> None:
        for problem in run_length_problems(args, state.max_steps, state.eval_steps):
            log.warning(problem)


def run_length_problems(args: TrainingArguments, steps: int, eval_steps: float | None) -> list[str]:
    """What of the schedule a run of `steps` optimizer steps never reaches: the end of its warmup (quickstart-chat's
    36 steps with warmup_steps 200 peaked at 17.5% of learning_rate and ended at eval loss 3.23 against 1.87 with
    warmup 5), or its first evaluation under eval_strategy steps."""
    problems = []
    warmup = args.get_warmup_steps(steps)
    if steps > 0 and warmup >= steps:
        problems.append(f"warmup_steps={args.warmup_steps:g} is {warmup} optimizer steps, and the run has {steps}: "
                        f"the learning rate rises for the whole run, reaches at most {(steps - 1) / warmup:.0%} of "
                        f"learning_rate={args.learning_rate:g} and never decays. Set warmup_steps below {steps}, or as "
                        "a share of the run (warmup_steps: 0.03).")
    if str(getattr(args.eval_strategy, "value", args.eval_strategy)) == "steps" and eval_steps and eval_steps > steps:
        problems.append(f"eval_steps={eval_steps:g} is beyond the run's {steps} optimizer steps: no evaluation runs "
                        "during training (only the final one), so nothing is compared for load_best_model_at_end or "
                        f"early stopping. Set eval_steps below {steps}, or as a share of the run (eval_steps: 0.1).")
    return problems
