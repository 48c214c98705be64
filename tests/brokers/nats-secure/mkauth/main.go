// mkauth writes the NKeys and JWTs of the nats-secure test servers (tests/brokers/nats-secure)
// into the directory named by its only argument, with NATS's own libraries (nats-io/jwt and
// nats-io/nkeys, what nsc uses): throwaway test identities made at every start, never committed.
//
//	resolver.conf       operator mode for the creds server: the operator JWT, the system
//	                    account and a memory resolver preloaded with the SYS and APP accounts
//	                    (APP has JetStream enabled)
//	user.creds          a user of APP (JWT + seed, the .creds format of `nsc generate creds`)
//	bad.creds           a user of an account the server does not know
//	nkey.seed nkey.pub  a plain NKey user for the accounts server (seed file, public key)
//	unknown-nkey.seed   an NKey user no server knows
package main

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nkeys"
)

func must[T any](v T, err error) T {
	if err != nil {
		fmt.Fprintln(os.Stderr, "mkauth:", err)
		os.Exit(1)
	}
	return v
}

func write(dir, name, text string) {
	must(0, os.WriteFile(filepath.Join(dir, name), []byte(text), 0o600))
}

// userCreds makes a user signed by the account key pair and returns its .creds text.
func userCreds(account nkeys.KeyPair, name string) string {
	user := must(nkeys.CreateUser())
	claims := jwt.NewUserClaims(must(user.PublicKey()))
	claims.Name = name
	token := must(claims.Encode(account))
	return string(must(jwt.FormatUserConfig(token, must(user.Seed()))))
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: mkauth DIR")
		os.Exit(2)
	}
	dir := os.Args[1]

	operator := must(nkeys.CreateOperator())
	sys := must(nkeys.CreateAccount())
	app := must(nkeys.CreateAccount())
	sysPub := must(sys.PublicKey())
	appPub := must(app.PublicKey())

	oc := jwt.NewOperatorClaims(must(operator.PublicKey()))
	oc.Name = "onceflow-test"
	oc.SystemAccount = sysPub
	opJWT := must(oc.Encode(operator))

	sc := jwt.NewAccountClaims(sysPub)
	sc.Name = "SYS"
	sysJWT := must(sc.Encode(operator))

	ac := jwt.NewAccountClaims(appPub)
	ac.Name = "APP"
	ac.Limits.JetStreamLimits = jwt.JetStreamLimits{
		MemoryStorage: jwt.NoLimit,
		DiskStorage:   jwt.NoLimit,
		Streams:       jwt.NoLimit,
		Consumer:      jwt.NoLimit,
	}
	appJWT := must(ac.Encode(operator))

	write(dir, "resolver.conf", fmt.Sprintf(
		"operator: %q\nsystem_account: %s\nresolver: MEMORY\nresolver_preload: {\n  %s: %q\n  %s: %q\n}\n",
		opJWT, sysPub, sysPub, sysJWT, appPub, appJWT))
	write(dir, "user.creds", userCreds(app, "onceflow"))
	write(dir, "bad.creds", userCreds(must(nkeys.CreateAccount()), "stranger"))

	nk := must(nkeys.CreateUser())
	write(dir, "nkey.seed", string(must(nk.Seed()))+"\n")
	write(dir, "nkey.pub", must(nk.PublicKey())+"\n")
	unknown := must(nkeys.CreateUser())
	write(dir, "unknown-nkey.seed", string(must(unknown.Seed()))+"\n")
}
