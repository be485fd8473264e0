"""The chaos suite: faults injected into real workers, PostgreSQL and RabbitMQ."""
