"""The README's set-up commands and config example stay true: CI runs the test command it
finds there, and the config example must load and plan with the real loader and planner."""

import pathlib
import re

from paraflex.config.schema import load_config
from paraflex.planner import plan

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _text():
    return README.read_text()


def test_readme_starts_with_two_setup_commands_serve_then_tests():
    setup = _text().split("## Set-up", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", setup, re.S)
    assert len(commands) == 2
    assert commands[0].startswith("pip install torch==2.13.0") and commands[0].endswith("paraflex serve")
    assert commands[1].startswith("pip install torch==2.13.0") and "pytest" in commands[1]


def test_readme_config_example_loads_and_plans(tmp_path):
    block = re.search(r"## Config reference.*?```yaml\n(.*?)```", _text(), re.S).group(1)
    path = tmp_path / "example.yaml"
    path.write_text(block)
    config = load_config(str(path))
    assert [m.name for m in config.models] == ["chat-70b", "small"]
    placement = plan(config)
    assert set(placement.models) == {"chat-70b", "small"}
    assert placement.objective > 0


def test_readme_python_snippets_import_only_main_dependencies():
    """The set-up command installs the main dependencies: every package a README Python block
    imports (outside paraflex itself) is one of them."""
    import tomllib

    project = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]
    main = {re.split(r"[<>=\[ ;]", d, 1)[0].lower() for d in project["dependencies"]}
    for block in re.findall(r"```python\n(.*?)```", _text(), re.S):
        for name in re.findall(r"^(?:from|import) (\w+)", block, re.M):
            assert name == "paraflex" or name in main, f"README imports {name}, not a main dependency"
