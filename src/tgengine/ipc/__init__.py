"""Child-process plumbing, below ``executor/`` and ``process/``: start a child with a socket
(``spawn``), whole messages over it (``wire``), calls awaiting their replies (``calls``),
exceptions that cross it (``portable``), a child noticing its parent died (``orphan``), and
weights handed over as a shared-memory file (``weights_file``)."""
