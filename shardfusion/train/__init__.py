"""The training job: ``python -m shardfusion.train`` (console script ``shardfusion-train``).

Not part of the library: ``import shardfusion`` never imports it. It needs the ``train`` extras (numpy, tqdm,
matplotlib, safetensors): ``pip install 'shardfusion[train]'``. One module per concern:

- ``job``: ``main``, the checks before any worker starts (``preflight``) and one worker's run (``train``);
- ``trainer``: the ``Trainer`` (build, ``train_step``, evaluate, save / resume, the loop) and ``trainer_outputs``,
  what it writes and prints;
- ``mode``: the one interface the modes plug in through: ``plain_mode``, ``pipeline_mode``, ``ft_mode``,
  ``outer_mode``;
- ``config``: ``JobConfig`` (the sections composed), ``ResolvedJob``, the flags generated from them, and the checks run before any worker starts;
- ``launch``: the local launcher (torch's elastic agent) and worker set-up;
- ``data``: the byte-level corpus and the seeded batch sampler;
- ``resume``: what a checkpoint of the job holds beyond the model and optimizer, and the resume checks;
- ``outputs``: the run folder (config.json, earlier runs moved aside);
- ``metrics``: metrics.jsonl, the summary and the loss plot.
"""
