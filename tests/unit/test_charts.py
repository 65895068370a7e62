"""tools/charts.py reads the tables the benchmarks print (the charts themselves need matplotlib)."""
from tools.charts import markdown_tables, worker_ratios

import pytest

pytestmark = pytest.mark.unit

WORKER_TABLE = """
| model | test | llama.cpp ggml-rpc-server | ours | ours/reference |
|---|---|---|---|---|
| A Q4_1 | pp128 t/s | 365.82 | 416.76 | 1.14 |
| | tg64 t/s | 113.94 | 125.65 | 1.10 |
| | load ms | 353 | 299 | 0.85 |
| B Q4_K_M | pp128 t/s | 452.65 | 399.07 | **0.88** |
| | peak RSS / client-allocated MiB | 361 / 896 | 478 / 896 | 0.53 of allocated |
"""


def test_worker_ratios_follow_each_model_down_its_rows():
    [(head, rows)] = markdown_tables(WORKER_TABLE)
    assert worker_ratios(head, rows) == [{"model": "A Q4_1", "pp": 1.14, "tg": 1.10},
                                         {"model": "B Q4_K_M", "pp": 0.88, "tg": None}]
