"""docs/config.md is what scripts/config_docs.py generates from the config models today."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_config_reference_is_current():
    done = subprocess.run(
        [sys.executable, "scripts/config_docs.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_every_field_is_documented():
    """Each field of every section appears in the page (a field added without regenerating fails above)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from config_docs import render

    from yatt.config import ExperimentConfig

    page = render()
    for name, field in ExperimentConfig.model_fields.items():
        assert f"## `{name}`" in page, name
        annotation = field.annotation
        if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
            for sub, info in annotation.model_fields.items():
                hidden = (info.json_schema_extra or {}).get("hidden")  # a test's fault injection
                assert (f"| `{sub}` |" in page) != bool(hidden), f"{name}.{sub}"
