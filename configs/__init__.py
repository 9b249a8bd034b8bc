"""The shipped configs: `paraflex.configs` is this folder in an installed package.

Place in the data flow: `paraflex.shipped.config_path` finds a config here (the demo that
`paraflex serve` / `paraflex plan` use when given none, the paper's configs) with
importlib.resources, so a wheel install has them too; no code lives here.
"""
