//! The lease table and checkpoints ([`CheckpointStore`]) on PostgreSQL:
//! [`PostgresCheckpointStore`], in the table `lease` of the store's schema (migration 2):
//!
//! ```sql
//! CREATE TABLE lease (
//!     grp         text NOT NULL,
//!     key         text NOT NULL,
//!     owner       text,
//!     counter     bigint NOT NULL,
//!     lease_until bigint NOT NULL,   -- ms since the epoch (server clock), 0 when unowned
//!     checkpoint  text,
//!     parents     text[] NOT NULL,
//!     PRIMARY KEY (grp, key));
//! ```
//!
//! Take, renew, release and checkpoint lock the batch's rows (`SELECT … ORDER BY key FOR
//! UPDATE`), decide every item under the lock on the server's clock, and write the changed rows
//! back with one `UPDATE … FROM unnest(…)`, in one transaction.

use std::collections::HashMap;
use std::time::Duration;

use async_trait::async_trait;
use onceflow_core::checkpoint::{
    self, CheckpointRequest, CheckpointStore, HeldLease, Lease, LeaseCounter, NewLease,
    TakeOutcome, TakeRequest,
};
use onceflow_core::Result;

use crate::{connect, Db, PostgresOptions, NOW_MS};

/// A lease table with checkpoints on PostgreSQL. Cheap to clone.
#[derive(Clone)]
pub struct PostgresCheckpointStore {
    db: Db,
}

impl std::fmt::Debug for PostgresCheckpointStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresCheckpointStore")
            .field("url", &self.db.shown)
            .field("schema", &self.db.schema)
            .finish()
    }
}

#[derive(Debug, Clone)]
struct Row {
    owner: Option<String>,
    counter: i64,
    lease_until: i64,
    checkpoint: Option<String>,
    parents: Vec<String>,
}

impl Row {
    fn lease(&self, key: &str, now: i64) -> Lease {
        let left = if self.owner.is_some() {
            (self.lease_until - now).max(0)
        } else {
            0
        };
        Lease {
            key: key.to_string(),
            owner: self.owner.clone(),
            counter: u64::try_from(self.counter).unwrap_or(0),
            expires_in: Duration::from_millis(u64::try_from(left).unwrap_or(0)),
            checkpoint: self.checkpoint.clone(),
            parents: self.parents.clone(),
        }
    }

    fn holds(&self, owner: &str, counter: LeaseCounter) -> bool {
        self.owner.as_deref() == Some(owner) && u64::try_from(self.counter).ok() == Some(counter)
    }
}

/// What a locked batch does to one row.
enum Op<'a> {
    Take(&'a TakeRequest),
    Renew(&'a HeldLease, Duration),
    Release(&'a HeldLease),
    Checkpoint(&'a CheckpointRequest),
}

/// The outcome of one item of a locked batch.
enum Out {
    Taken(LeaseCounter),
    Refused(Option<Lease>),
    Renewed(Option<LeaseCounter>),
    Flag(bool),
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 4)
}

impl PostgresCheckpointStore {
    /// Connects to the database at `url` (`postgres://user:password@host:port/database`,
    /// optional `?schema=S&pool_size=N`), creating or checking the schema.
    ///
    /// TLS and the password as for [`PostgresStore::open`](crate::PostgresStore::open)
    /// (libpq's `sslmode`, `sslrootcert`, `PGPASSWORD`, `~/.pgpass`).
    ///
    /// Errors: [`onceflow_core::ErrorKind::Config`] for a malformed URL or bad option;
    /// [`onceflow_core::ErrorKind::Auth`] when the server refuses the password or a TLS
    /// certificate; [`onceflow_core::ErrorKind::DedupStore`] when the database cannot be
    /// reached or holds a schema from a newer onceflow. Messages name the URL without its
    /// password.
    pub async fn open(url: &str) -> Result<Self> {
        let db = connect(url, &PostgresOptions::new(Duration::from_secs(1))).await?;
        Ok(PostgresCheckpointStore { db })
    }

    fn t(&self) -> String {
        self.db.t("lease")
    }

    fn select(&self) -> String {
        format!(
            "SELECT key, owner, counter, lease_until, checkpoint, parents, {NOW_MS} FROM {}",
            self.t()
        )
    }

    fn rows(rows: &[tokio_postgres::Row]) -> (HashMap<String, Row>, i64) {
        let mut now = 0;
        let map = rows
            .iter()
            .map(|r| {
                now = now.max(r.get::<_, i64>(6));
                (
                    r.get(0),
                    Row {
                        owner: r.get(1),
                        counter: r.get(2),
                        lease_until: r.get(3),
                        checkpoint: r.get(4),
                        parents: r.get(5),
                    },
                )
            })
            .collect();
        (map, now)
    }

    /// Locks the rows of `ops`, applies them in order, writes the changed rows back.
    async fn locked(&self, group: &str, ops: Vec<(String, Op<'_>)>) -> Result<Vec<Out>> {
        if ops.is_empty() {
            return Ok(Vec::new());
        }
        let mut keys: Vec<String> = ops.iter().map(|(k, _)| k.clone()).collect();
        keys.sort();
        keys.dedup();
        const WHAT: &str = "checkpoint store update failed";
        let mut client = self.db.client().await?;
        let mut tries = 0;
        loop {
            tries += 1;
            let Some(r) = (self.db)
                .within(self.locked_once(&mut client, group, &keys, &ops))
                .await
            else {
                return Err(self.db.timed_out(WHAT, client));
            };
            match r {
                Err(e) if crate::is_race(&e) && tries < crate::MAX_TRIES => {
                    tokio::time::sleep(Duration::from_millis(rand::random::<u64>() % 20)).await;
                }
                r => return r.map_err(|e| self.db.error(WHAT, e)),
            }
        }
    }

    async fn locked_once(
        &self,
        client: &mut deadpool_postgres::Object,
        group: &str,
        keys: &[String],
        ops: &[(String, Op<'_>)],
    ) -> std::result::Result<Vec<Out>, tokio_postgres::Error> {
        let tx = client.transaction().await?;
        let rows = tx
            .query(
                &format!(
                    "{} WHERE grp = $1 AND key = ANY($2::text[]) ORDER BY key FOR UPDATE",
                    self.select()
                ),
                &[&group, &keys],
            )
            .await?;
        let (mut state, now) = Self::rows(&rows);
        let mut changed = std::collections::BTreeSet::new();
        let mut out = Vec::with_capacity(ops.len());
        for (key, op) in ops {
            let row = state.get_mut(key);
            out.push(match (op, row) {
                (Op::Take(_), None) => Out::Refused(None),
                (Op::Take(req), Some(row)) => {
                    let free = match &row.owner {
                        None => true,
                        Some(o) => o == &req.owner || row.lease_until <= now,
                    };
                    if free && u64::try_from(row.counter).ok() == Some(req.expected_counter) {
                        row.owner = Some(req.owner.clone());
                        row.counter += 1;
                        row.lease_until = now.saturating_add(ms(req.lease));
                        changed.insert(key.clone());
                        Out::Taken(u64::try_from(row.counter).unwrap_or(0))
                    } else {
                        Out::Refused(Some(row.lease(key, now)))
                    }
                }
                (Op::Renew(..), None) => Out::Renewed(None),
                (Op::Renew(held, lease), Some(row)) => {
                    if row.holds(&held.owner, held.counter) {
                        row.counter += 1;
                        row.lease_until = now.saturating_add(ms(*lease));
                        changed.insert(key.clone());
                        Out::Renewed(u64::try_from(row.counter).ok())
                    } else {
                        Out::Renewed(None)
                    }
                }
                (Op::Release(_), None) | (Op::Checkpoint(_), None) => Out::Flag(false),
                (Op::Release(held), Some(row)) => {
                    if row.holds(&held.owner, held.counter) {
                        row.owner = None;
                        row.counter += 1;
                        row.lease_until = 0;
                        changed.insert(key.clone());
                        Out::Flag(true)
                    } else {
                        Out::Flag(false)
                    }
                }
                (Op::Checkpoint(req), Some(row)) => {
                    if row.holds(&req.owner, req.counter) {
                        row.checkpoint = Some(req.checkpoint.clone());
                        changed.insert(key.clone());
                        Out::Flag(true)
                    } else {
                        Out::Flag(false)
                    }
                }
            });
        }
        if !changed.is_empty() {
            let (mut k, mut o, mut c, mut l, mut cp) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for key in &changed {
                let row = &state[key];
                k.push(key.as_str());
                o.push(row.owner.as_deref());
                c.push(row.counter);
                l.push(row.lease_until);
                cp.push(row.checkpoint.as_deref());
            }
            tx.execute(
                &format!(
                    "UPDATE {} AS t SET owner = u.owner, counter = u.counter, \
                     lease_until = u.lu, checkpoint = u.cp \
                     FROM unnest($2::text[], $3::text[], $4::bigint[], $5::bigint[], $6::text[]) \
                     AS u(key, owner, counter, lu, cp) WHERE t.grp = $1 AND t.key = u.key",
                    self.t()
                ),
                &[&group, &k, &o, &c, &l, &cp],
            )
            .await?;
        }
        tx.commit().await?;
        Ok(out)
    }
}

/// `true` for the first occurrence of each key in `keys` that is in `hit`.
fn first_hits(
    keys: impl Iterator<Item = String>,
    hit: &std::collections::HashSet<String>,
) -> Vec<bool> {
    let mut seen = std::collections::HashSet::new();
    keys.map(|k| hit.contains(&k) && seen.insert(k)).collect()
}

#[async_trait]
impl CheckpointStore for PostgresCheckpointStore {
    fn name(&self) -> &'static str {
        "postgres"
    }

    async fn list(&self, group: &str) -> Result<Vec<Lease>> {
        checkpoint::validate(group, [], [])?;
        const WHAT: &str = "checkpoint list failed";
        let client = self.db.client().await?;
        let sql = format!(
            "{} WHERE grp = $1 ORDER BY key COLLATE \"C\"",
            self.select()
        );
        let Some(rows) = self.db.within(client.query(&sql, &[&group])).await else {
            return Err(self.db.timed_out(WHAT, client));
        };
        let rows = rows.map_err(|e| self.db.error(WHAT, e))?;
        Ok(rows
            .iter()
            .map(|r| {
                let row = Row {
                    owner: r.get(1),
                    counter: r.get(2),
                    lease_until: r.get(3),
                    checkpoint: r.get(4),
                    parents: r.get(5),
                };
                row.lease(r.get::<_, &str>(0), r.get(6))
            })
            .collect())
    }

    async fn get(&self, group: &str, keys: &[String]) -> Result<Vec<Option<Lease>>> {
        checkpoint::validate(group, keys.iter().map(String::as_str), [])?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        const WHAT: &str = "checkpoint get failed";
        let client = self.db.client().await?;
        let sql = format!("{} WHERE grp = $1 AND key = ANY($2::text[])", self.select());
        let Some(rows) = self.db.within(client.query(&sql, &[&group, &keys])).await else {
            return Err(self.db.timed_out(WHAT, client));
        };
        let rows = rows.map_err(|e| self.db.error(WHAT, e))?;
        let (state, now) = Self::rows(&rows);
        Ok(keys
            .iter()
            .map(|k| state.get(k).map(|r| r.lease(k, now)))
            .collect())
    }

    async fn create(&self, group: &str, leases: &[NewLease]) -> Result<Vec<bool>> {
        checkpoint::validate(group, leases.iter().map(|l| l.key.as_str()), [])?;
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        const WHAT: &str = "checkpoint create failed";
        let mut client = self.db.client().await?;
        let sql = format!(
            "INSERT INTO {} (grp, key, owner, counter, lease_until, checkpoint, parents) \
             VALUES ($1, $2, NULL, 0, 0, $3, $4) ON CONFLICT (grp, key) DO NOTHING",
            self.t()
        );
        let insert = async {
            let tx = client.transaction().await?;
            let mut created = std::collections::HashSet::new();
            // One statement per row: a row's parents are an array, which unnest would flatten.
            for l in leases {
                let n = tx
                    .execute(&sql, &[&group, &l.key, &l.checkpoint, &l.parents])
                    .await?;
                if n == 1 {
                    created.insert(l.key.clone());
                }
            }
            tx.commit().await?;
            Ok::<_, tokio_postgres::Error>(created)
        };
        let Some(created) = self.db.within(insert).await else {
            return Err(self.db.timed_out(WHAT, client));
        };
        let created = created.map_err(|e| self.db.error(WHAT, e))?;
        Ok(first_hits(leases.iter().map(|l| l.key.clone()), &created))
    }

    async fn take(&self, group: &str, requests: &[TakeRequest]) -> Result<Vec<TakeOutcome>> {
        checkpoint::validate(
            group,
            requests.iter().map(|r| r.key.as_str()),
            requests.iter().map(|r| r.owner.as_str()),
        )?;
        let ops = requests
            .iter()
            .map(|r| (r.key.clone(), Op::Take(r)))
            .collect();
        Ok(self
            .locked(group, ops)
            .await?
            .into_iter()
            .map(|o| match o {
                Out::Taken(counter) => TakeOutcome::Taken { counter },
                Out::Refused(current) => TakeOutcome::Refused { current },
                _ => TakeOutcome::Refused { current: None },
            })
            .collect())
    }

    async fn renew(
        &self,
        group: &str,
        leases: &[HeldLease],
        lease: Duration,
    ) -> Result<Vec<Option<LeaseCounter>>> {
        checkpoint::validate(
            group,
            leases.iter().map(|l| l.key.as_str()),
            leases.iter().map(|l| l.owner.as_str()),
        )?;
        let ops = leases
            .iter()
            .map(|l| (l.key.clone(), Op::Renew(l, lease)))
            .collect();
        Ok(self
            .locked(group, ops)
            .await?
            .into_iter()
            .map(|o| match o {
                Out::Renewed(c) => c,
                _ => None,
            })
            .collect())
    }

    async fn release(&self, group: &str, leases: &[HeldLease]) -> Result<Vec<bool>> {
        checkpoint::validate(
            group,
            leases.iter().map(|l| l.key.as_str()),
            leases.iter().map(|l| l.owner.as_str()),
        )?;
        let ops = leases
            .iter()
            .map(|l| (l.key.clone(), Op::Release(l)))
            .collect();
        Ok(self
            .locked(group, ops)
            .await?
            .into_iter()
            .map(|o| matches!(o, Out::Flag(true)))
            .collect())
    }

    async fn checkpoint(&self, group: &str, requests: &[CheckpointRequest]) -> Result<Vec<bool>> {
        checkpoint::validate(
            group,
            requests.iter().map(|r| r.key.as_str()),
            requests.iter().map(|r| r.owner.as_str()),
        )?;
        let ops = requests
            .iter()
            .map(|r| (r.key.clone(), Op::Checkpoint(r)))
            .collect();
        Ok(self
            .locked(group, ops)
            .await?
            .into_iter()
            .map(|o| matches!(o, Out::Flag(true)))
            .collect())
    }

    async fn delete(&self, group: &str, keys: &[String]) -> Result<Vec<bool>> {
        checkpoint::validate(group, keys.iter().map(String::as_str), [])?;
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        const WHAT: &str = "checkpoint delete failed";
        let client = self.db.client().await?;
        let sql = format!(
            "DELETE FROM {} WHERE grp = $1 AND key = ANY($2::text[]) RETURNING key",
            self.t()
        );
        let Some(rows) = self.db.within(client.query(&sql, &[&group, &keys])).await else {
            return Err(self.db.timed_out(WHAT, client));
        };
        let rows = rows.map_err(|e| self.db.error(WHAT, e))?;
        let hit = rows.iter().map(|r| r.get::<_, String>(0)).collect();
        Ok(first_hits(keys.iter().cloned(), &hit))
    }
}
