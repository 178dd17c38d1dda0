"""All-to-all codecs: the interface (``base``), plain casts (``cast``), the name registry (``registry``), the
error-bounded codec with adaptive bounds (``eb``), what a training run needs of them (``runtime``) and the
payload capture and analysis tools (``analysis``). Nothing here imports ``recstack.distributed``."""
