// P2's Java contender (benches/src/pulsar_txn.rs compiles and runs it): a consume-transform-
// produce loop with the official Apache Pulsar Java client (org.apache.pulsar:pulsar-client-original,
// the jars tests/brokers/pulsar/up.sh fetches from Maven Central for the broker), committing a
// transaction every 100 ms, as onceflow's transactional Pipeline does.
//
//   java -cp CLASSES:LIBS/* PulsarTxnLoop SERVICE_URL INPUT OUTPUT SUBSCRIPTION N
//
// Reads N messages of INPUT (failover subscription from the earliest message, batch receive of up
// to 500 messages or 10 ms), sends each payload with its key to OUTPUT inside the open
// transaction (producer batching 1000 messages or 5 ms, as onceflow's side), acknowledges each
// received batch inside the transaction (Consumer.acknowledgeAsync(Messages, Transaction)), and
// every 100 ms waits for the sends and acknowledgements, commits, and opens the next transaction
// (transaction timeout 60 s, onceflow's default). The clock starts before the client is built and
// stops after the last commit; the last stdout line is the rate in messages per second.
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;

import org.apache.pulsar.client.api.BatchReceivePolicy;
import org.apache.pulsar.client.api.Consumer;
import org.apache.pulsar.client.api.Message;
import org.apache.pulsar.client.api.Messages;
import org.apache.pulsar.client.api.Producer;
import org.apache.pulsar.client.api.PulsarClient;
import org.apache.pulsar.client.api.Schema;
import org.apache.pulsar.client.api.SubscriptionInitialPosition;
import org.apache.pulsar.client.api.SubscriptionType;
import org.apache.pulsar.client.api.TypedMessageBuilder;
import org.apache.pulsar.client.api.transaction.Transaction;

public final class PulsarTxnLoop {
    public static void main(String[] args) throws Exception {
        if (args.length != 5) {
            System.err.println("usage: PulsarTxnLoop SERVICE_URL INPUT OUTPUT SUBSCRIPTION N");
            System.exit(2);
        }
        String url = args[0], input = args[1], output = args[2], sub = args[3];
        long n = Long.parseLong(args[4]);
        long start = System.nanoTime();
        PulsarClient client = PulsarClient.builder()
                .serviceUrl(url)
                .enableTransaction(true)
                .build();
        Consumer<byte[]> consumer = client.newConsumer(Schema.BYTES)
                .topic(input)
                .subscriptionName(sub)
                .subscriptionType(SubscriptionType.Failover)
                .subscriptionInitialPosition(SubscriptionInitialPosition.Earliest)
                .batchReceivePolicy(BatchReceivePolicy.builder()
                        .maxNumMessages(500)
                        .timeout(10, TimeUnit.MILLISECONDS)
                        .build())
                .subscribe();
        // A transactional producer needs sendTimeout 0 (the Java client refuses others).
        Producer<byte[]> producer = client.newProducer(Schema.BYTES)
                .topic(output)
                .sendTimeout(0, TimeUnit.SECONDS)
                .enableBatching(true)
                .batchingMaxMessages(1000)
                .batchingMaxPublishDelay(5, TimeUnit.MILLISECONDS)
                .blockIfQueueFull(true)
                .create();
        Transaction txn = newTxn(client);
        long txStarted = System.nanoTime();
        List<CompletableFuture<?>> pending = new ArrayList<>();
        long done = 0;
        long commits = 0;
        while (done < n) {
            Messages<byte[]> msgs = consumer.batchReceive();
            if (msgs.size() > 0) {
                for (Message<byte[]> m : msgs) {
                    TypedMessageBuilder<byte[]> b = producer.newMessage(txn).value(m.getValue());
                    if (m.hasKey()) {
                        b = b.key(m.getKey());
                    }
                    pending.add(b.sendAsync());
                }
                pending.add(consumer.acknowledgeAsync(msgs, txn));
                done += msgs.size();
            }
            if (System.nanoTime() - txStarted >= 100_000_000L || done >= n) {
                CompletableFuture.allOf(pending.toArray(new CompletableFuture<?>[0])).get();
                pending.clear();
                txn.commit().get();
                commits++;
                if (done < n) {
                    txn = newTxn(client);
                }
                txStarted = System.nanoTime();
            }
        }
        double secs = (System.nanoTime() - start) / 1e9;
        producer.close();
        consumer.close();
        client.close();
        System.err.printf("java txn loop: %d messages, %d commits, %.3f s%n", done, commits, secs);
        System.out.printf("%.1f%n", n / secs);
    }

    private static Transaction newTxn(PulsarClient client) throws Exception {
        return client.newTransaction()
                .withTransactionTimeout(60, TimeUnit.SECONDS)
                .build()
                .get();
    }
}
