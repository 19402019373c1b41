"""``python -m fspo.config``: docs/configuration.md's generated part rendered anew from the schemas."""
from fspo.config import DOCS, docs_page

DOCS.write_text(docs_page(DOCS.read_text()))
