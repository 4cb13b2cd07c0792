"""The fact store: models, lineage, replicas, decisions and outcomes (SQLAlchemy Core)."""
