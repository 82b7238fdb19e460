"""The journal: records, the bounded ring, the SQLite store, and the fold.

Import from the modules (``enginelink.journal.records`` etc.); this package
file stays empty so importing one piece does not pull in the others.
"""
