module onceflow.test/brokers/nats-secure/mkauth

go 1.23.0

require (
	github.com/nats-io/jwt/v2 v2.8.0
	github.com/nats-io/nkeys v0.4.11
)

require (
	golang.org/x/crypto v0.37.0 // indirect
	golang.org/x/sys v0.32.0 // indirect
)
