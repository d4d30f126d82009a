"""Data: the synthetic world (`world`), the assistant task suite (`assistant_suite`) and GSM8K from
local files (`gsm8k`); the suite and GSM8K are tfds builders read with `tfds.data_source`, whose
metadata stays local (`tfds_local`)."""
