"""Optional integrations with other libraries, each behind its own extra.

Nothing here is imported by ``import graphslot``: each integration imports its library
when it is imported itself, and says which extra installs it when it is missing
(``graphslot.integrations.transformers`` needs ``pip install 'graphslot[hf]'``).
"""
