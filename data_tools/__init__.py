"""Data-stage entry scripts (docs/data.md): ``python data_tools/NAME.py`` or ``python -m data_tools.NAME``
for NAME in train_tokenizer, preprocess_data, inspect_shards, make_eval_tasks. Each is a thin shell
over ``megahash.data.preprocess.NAME.main``, where all the code lives."""
