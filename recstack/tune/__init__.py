"""``recstack tune``: a search over a recipe's options on the user's validation split, with
Optuna's TPE sampler and median pruner, each trial a real ``recstack train`` process (``space``,
``trial_run``, ``study``, ``report``)."""
