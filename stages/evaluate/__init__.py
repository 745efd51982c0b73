"""The evaluate stage: lm-evaluation-harness over every model variant the lifecycle produced.

task_family.py (verifiable problems with train/held-out splits and an exact checker, shared with
post-train), backends.py + lm_model.py (the `eightfold` lm-eval model over the serving engine, or
transformers), tasks/ (YAML templates of the offline suite) + suite.py (writes them with their data),
run.py (variant discovery, one offline lm-eval run per variant), compare.py (the variants x tasks
table, nested MLflow runs), gates.py (conditions from config that fail the stage), promote.py
(the registry's champion or challenger alias for the exported model, from the gates and the primary
metric), decontam.py (eval texts handed to the data stage's decontamination), stage.py (`run(ctx)`) and command.py
(`evaluate_command`, for `eightfold eval DIR...` outside a lifecycle).

Importing this package registers the task family's held-out texts with the data stage's
decontamination; lm-eval itself is imported only by the modules that use it.
"""

from .decontam import register as _register_decontamination

_register_decontamination()
