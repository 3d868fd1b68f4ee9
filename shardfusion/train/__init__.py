"""The training job: ``python -m shardfusion.train`` (console script ``shardfusion-train``).

Not part of the library: ``import shardfusion`` never imports it. It needs the ``train`` extras (numpy, tqdm,
matplotlib, safetensors): ``pip install 'shardfusion[train]'``. One module per concern:

- ``job``: one worker's run (build, wrap, train, evaluate, save) and ``main``;
- ``config``: ``JobConfig`` (the sections composed), ``ResolvedJob``, the flags generated from them, and the checks run before any worker starts;
- ``launch``: the local launcher (torch's elastic agent) and worker set-up;
- ``data``: the byte-level corpus and the seeded batch sampler;
- ``resume``: what a checkpoint of the job holds beyond the model and optimizer, and the resume checks;
- ``outputs``: the run folder (config.json, earlier runs moved aside);
- ``metrics``: metrics.jsonl, the summary and the loss plot.
"""
