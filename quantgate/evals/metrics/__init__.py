"""quantgate's metrics: `evaluate` modules written here (one file each) and the table that describes them.

The table (`table.yaml`) is data: metric name -> module file, direction, aggregation, binary or not.
This package imports neither `evaluate` nor `datasets`; `quantgate.evals.scoring` loads the modules when needed.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, RootModel, ValidationInfo, field_validator
from quantgate.base.yamlconfig import load_model

METRICS_DIR = Path(__file__).resolve().parent
TABLE = METRICS_DIR / "table.yaml"


class MetricSpec(BaseModel):
    """One row of the metric table."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    module: str
    higher_is_better: bool
    aggregation: Literal["mean"]
    binary: bool

    @field_validator("module")
    @classmethod
    def _module_exists(cls, v: str, info: ValidationInfo) -> str:
        base = Path((info.context or {}).get("path", TABLE)).parent
        if not (base / v).is_file():
            raise ValueError(f"module file {base / v} does not exist")
        return v

    def path(self, table: Path = TABLE) -> Path:
        return Path(table).parent / self.module


class MetricTable(RootModel[dict[str, MetricSpec]]):
    pass


@lru_cache(maxsize=4)
def load_table(path: Path | str = TABLE) -> dict[str, MetricSpec]:
    """The metric table as {name: MetricSpec}; errors name the file, line and field."""
    return dict(load_model(Path(path), MetricTable).root)
