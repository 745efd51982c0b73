"""The ablations stage (seed: "Data mixture, learning rate, batch size and architecture are chosen with
ablations on small proxy models and scaling laws fitted to them"): `proxies.py` derives proxy shapes,
budgets and the sweep (learning rate, batch size, schedule, data mixture) from the config; `runner.py`
trains one proxy as a trainer job (cached by its own fingerprint, one nested MLflow run each); `fit.py`
fits the best learning rate per size and the scaling laws with scipy; `plots.py` draws them; `stage.py`
ties it together and writes `choice.json`, which `choice.py` applies to pretrain. Prefect-free: a Prefect
runner that maps proxies as concurrent tasks lives in tasks/ablations.py."""
