"""The spec layer: the YAML format's model, validation, expressions, params and
slots resolved, hooks by name, [tool.graphslot]. Imports no torch."""
