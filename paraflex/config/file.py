"""Config files as plain data: a YAML (.yaml/.yml) or JSON (.json) file -> dicts and lists.

Place in the data flow: `paraflex.config.schema.load_config` calls `read_config_file` first, then
validates the data into `Config` dataclasses. Every problem with the file itself (missing, not
UTF-8, bad syntax, unknown extension, a key given twice in one mapping) is a one-line
`UserError` naming the file; no YAML or JSON library error reaches the user.
"""

from __future__ import annotations

import json
import os

from paraflex.errors import UserError


def read_config_file(path: str):
    """The parsed content of the config file at `path` (None for an empty YAML file)."""
    if not os.path.isfile(path):
        raise UserError(f"config file {path} does not exist")
    ext = os.path.splitext(path)[1].lower()
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise UserError(f"cannot read config {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise UserError(f"config {path} is not UTF-8 text; give a YAML or JSON config file") from None
    if ext == ".json":
        try:
            data = json.loads(text, object_pairs_hook=_unique_keys(path))
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
    elif ext in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.load(text, Loader=_unique_key_loader())
        except yaml.YAMLError as exc:
            raise UserError(f"{path}: invalid YAML: {' '.join(str(exc).split())}") from None
    else:
        raise UserError(f"config {path}: unknown extension {ext!r}; use .yaml, .yml or .json")
    return data


def _unique_keys(path: str):
    """json's object_pairs_hook: a key given twice in one object is an error (the last would win)."""
    def hook(pairs):
        out = {}
        for k, v in pairs:
            if k in out:
                raise UserError(f"{path}: key {k!r} appears twice in one object; give each key once")
            out[k] = v
        return out
    return hook


def _unique_key_loader():
    """yaml's SafeLoader refusing a key given twice in one mapping (it would keep the last)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:  # an unhashable key: the base class reports it
                    continue
                if duplicate:
                    raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice in one mapping; "
                                                            "give each key once", key_node.start_mark)
            return super().construct_mapping(node, deep)

    return UniqueKeyLoader
