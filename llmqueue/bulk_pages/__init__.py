"""The /bulk/ pages: upload, watch, cancel and download bulk jobs in a browser (login required)."""
